"""``cartspec serve`` wiring (against a fake upstream) and the typed service config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cartspec.agent.defaults import default_spec
from cartspec.agent.config import AgentConfig, RouterConfig
from cartspec.model.convert import ModelNotFound
from test_agent_app import FakeUpstream, _free_port
from test_serving_cleanup import STANDIN


def wait_ready(proc: subprocess.Popen, port: int) -> str:
    """The base URL of a `cartspec serve` subprocess once it answers /ready (fails with its output if it dies)."""
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            if httpx.get(base + "/ready", timeout=1).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "slow"
        time.sleep(0.2)


def test_default_spec_uses_a_head_when_there_is_one(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    spec = default_spec("commerce", str(head), 3, enforce_eager=False)
    # the bundled model drafts with the hybrid and the pointer trained for it: the hybrid's default for it
    assert spec.speculative.method == "hybrid" and spec.speculative.num_speculative_tokens == 3
    from cartspec.model.registry import resolve_model

    assert spec.speculative.hybrid is None
    assert spec.speculative.hybrid_config(resolve_model("commerce")).rule == "pointer"
    assert "--enable-per-request-metrics" in spec.engine_args
    spec = default_spec("commerce", str(head), 3, enforce_eager=False, draft="eagle3")
    assert spec.speculative.method == "eagle3" and spec.speculative.hybrid is None


def test_default_spec_serves_the_head_alone_for_a_model_no_pointer_was_trained_for(tiny_llama_dir, tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    said = []
    spec = default_spec(str(tiny_llama_dir), str(head), 3, enforce_eager=False, say=said.append)
    # the hybrid's default rule there is the head alone: served as the head, and the user is told why
    assert spec.speculative.method == "eagle3" and spec.speculative.hybrid is None
    assert any("no pointer was trained for this target" in m and "cartspec draft pointer" in m for m in said)
    # with the pointer trained for it (serve --pointer DIR), the hybrid drafts with rule pointer
    spec = default_spec(str(tiny_llama_dir), str(head), 3, enforce_eager=False, pointer=str(tmp_path / "ptr"))
    sp = spec.speculative
    assert (sp.method, sp.hybrid.rule, sp.hybrid.pointer) == ("hybrid", "pointer", str(tmp_path / "ptr"))


def test_default_spec_without_head_serves_the_schema_drafter(monkeypatch, tmp_path):
    import cartspec.model.registry as registry

    monkeypatch.setattr(registry, "HEADS_DIR", tmp_path / "no-heads")
    assert default_spec("commerce", "auto", 3, False).speculative.method == "schema"  # needs no head
    assert default_spec("commerce", "none", 3, False).speculative.method == "none"
    with pytest.raises(ModelNotFound):
        default_spec("commerce", "domain", 3, False)  # asked for explicitly: an error, not a silent fallback


@pytest.mark.parametrize("suffix", [".yaml", ".toml", ".json"])
def test_config_round_trips(tmp_path, suffix):
    cfg = AgentConfig(port=9000, api_key="k", router=RouterConfig(enabled=True, policy="load"))
    path = tmp_path / f"agent{suffix}"
    if suffix == ".toml":
        path.write_text('port = 9000\napi_key = "k"\n[router]\nenabled = true\npolicy = "load"\n')
    else:
        cfg.save(path)
    assert AgentConfig.load(path) == cfg


def test_config_rejects_unknown_keys_and_bad_timeouts():
    with pytest.raises(ValueError):
        AgentConfig.model_validate({"prot": 8080})
    with pytest.raises(ValueError):
        AgentConfig(upstream_timeout_s=30, request_timeout_s=10)


def test_serve_with_upstream_answers_and_stops_on_ctrl_c(tmp_path):
    fake = FakeUpstream().start()
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cartspec.cli", "serve", "--upstream", fake.url,
                             "--label", "ngram-g3", "--port", str(port), "--trace", str(tmp_path / "t.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = wait_ready(proc, port)
        r = httpx.post(base + "/v1/search", json={"query": "red running shoes"})
        assert r.status_code == 200 and r.headers["x-cartspec-deployment"] == "ngram-g3"
        assert r.json()["keywords"] == "running shoes"
        assert httpx.get(base + "/v1/info").json()["deployments"]["speculative"]["label"] == "ngram-g3"
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(15) == 0
        assert (tmp_path / "t.jsonl").read_text().count("\n") == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        fake.stop()


def test_keeper_restarts_a_deployment_that_died(tmp_path):
    from cartspec.agent.supervisor import Keeper
    from cartspec.serving.spec import DeploymentSpec
    from test_serving_cleanup import STANDIN, StandIn

    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    server = StandIn(str(script), "ok", DeploymentSpec(start_timeout_s=30), log_dir=tmp_path)
    with server:
        keeper = Keeper(server, every_s=0.2)
        keeper.start()
        try:
            first = server.proc.pid
            os.kill(first, signal.SIGKILL)
            deadline = time.time() + 20
            while keeper.restarts == 0:
                assert time.time() < deadline, "not restarted"
                time.sleep(0.1)
            assert server.alive() and server.proc.pid != first
            assert httpx.get(server.url + "/health").status_code == 200
        finally:
            keeper.stopping.set()
            keeper.join(5)


def test_serve_adaptive_without_a_cached_schedule_calibrates_into_the_tuning_cache(monkeypatch, tmp_path):
    """``serve --adaptive`` has no study run of its own: the schedule cached for this machine, else a calibration
    run into its own directory of the tuning cache (then cached, so the next serve starts at once)."""
    from cartspec.agent.cli import adaptive_schedule
    from cartspec.agent.defaults import adaptive_request
    from cartspec.bench import adaptive, sweep as sweep_mod
    from cartspec.serving.spec import DeploymentSpec, Speculative
    from synthetic_sweep import sweep

    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(adaptive, "cache_key", lambda spec: "k")  # no real model resolved in a unit test
    calibrated = []

    def calibrate(spec, cal_dir, launcher=None, reporter=None):
        calibrated.append(cal_dir)
        return sweep(concurrencies=(1, 4, 16), temperatures=(0.0,), deployments=(("none", 0), ("eagle3", 5)))

    monkeypatch.setattr(sweep_mod, "run_calibration", calibrate)  # the calibration sweep
    spec = adaptive_request(DeploymentSpec(speculative=Speculative(method="eagle3", model="domain",
                                                                   num_speculative_tokens=3), dtype="float32"))
    first = adaptive_schedule(spec)
    assert calibrated == [adaptive.tune_dir() / "calibrate-k"] and first.speculative.schedule
    again = adaptive_schedule(spec)  # cached now: no second calibration
    assert len(calibrated) == 1 and again.speculative.schedule == first.speculative.schedule
    with pytest.raises(ValueError, match="--adaptive needs an EAGLE-3 head"):
        adaptive_request(DeploymentSpec(speculative=Speculative(method="hybrid", model="domain",
                                                                num_speculative_tokens=3)))


KEEPER_UNDER_SIGTERM = '''
import sys, time
sys.path.insert(0, sys.argv[1])
from test_serving_cleanup import StandIn
from cartspec.agent.supervisor import Keeper
from cartspec.serving.server import install_signal_handlers
from cartspec.serving.spec import DeploymentSpec
install_signal_handlers()
server = StandIn(sys.argv[2], "ok", DeploymentSpec(start_timeout_s=30), log_dir=sys.argv[3]).start()
keeper = Keeper(server, every_s=0.02, say=lambda m: print(m, flush=True))
keeper.start()
print("ready", server.log_path, flush=True)
time.sleep(120)
'''


def test_a_program_stopped_by_sigterm_restarts_nothing_and_keeps_the_engine_log(tmp_path):
    """SIGTERM stops the deployments the program owns; its keeper, which watches them die, must not restart
    one (a restart truncated the engine's log to its command line and started an engine for nothing)."""
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    prog = tmp_path / "prog.py"
    prog.write_text(KEEPER_UNDER_SIGTERM)
    proc = subprocess.Popen([sys.executable, str(prog), str(Path(__file__).parent), str(script), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("ready"), first + proc.stdout.read()
        log_path = Path(first.split(None, 1)[1].strip())
        assert "worker" in log_path.read_text()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGTERM, out
    assert "restarting" not in out, out
    assert "worker" in log_path.read_text(), "the engine's log was truncated by a restart"


def test_nothing_starts_a_deployment_once_the_program_is_stopping(tmp_path, monkeypatch):
    import threading

    from cartspec.agent.supervisor import Keeper
    from cartspec.serving import process
    from cartspec.serving.server import DeploymentError, VllmServer
    from cartspec.serving.spec import DeploymentSpec

    stopping = threading.Event()
    monkeypatch.setattr(process, "_SHUTDOWN", stopping)
    calls = []

    class Dead:
        spec, url, log_path = DeploymentSpec(), "http://127.0.0.1:1", tmp_path / "x.log"

        def alive(self):
            return False

        def restart(self):
            calls.append(1)

    stopping.set()
    keeper = Keeper(Dead(), every_s=0.01)
    keeper.start()
    keeper.join(2)  # the keeper returns at once: the program is stopping
    assert not keeper.is_alive() and calls == []
    with pytest.raises(DeploymentError, match="stopping"):
        VllmServer(DeploymentSpec(), log_dir=tmp_path).start()
    assert not list(tmp_path.glob("vllm-*.log"))
