"""No process is left behind: after a failed start, a stop, or a caller that is
interrupted or killed.

The fast tests run ``VllmServer``'s process machinery on a stand-in server (a
python process that spawns a worker child and answers /health, like vLLM's API
server and engine core); the ``vllm`` tests do the same with the real engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from cartspec.serving.server import DeploymentError, VllmServer
from cartspec.serving.spec import DeploymentSpec

STANDIN = textwrap.dedent('''
    import http.server, signal, subprocess, sys, time
    port, mode = int(sys.argv[1]), sys.argv[2]
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like the engine core
    print("worker", worker.pid, flush=True)
    if mode == "fail":
        print("ValueError: max_model_len 99999 exceeds the model's 1024", flush=True)
        sys.exit(3)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "slow":
        time.sleep(600)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
''')

CALLER = textwrap.dedent('''
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_serving_cleanup import StandIn
    from cartspec.serving.server import install_signal_handlers
    from cartspec.serving.spec import DeploymentSpec
    install_signal_handlers()  # as the cartspec CLI does: on SIGTERM the caller stops it (the watchdog is the backstop)
    server = StandIn({script!r}, {mode!r}, DeploymentSpec(start_timeout_s=60), log_dir={log_dir!r})
    server.start()
    print("PIDS", *server.pids(), flush=True)
    {after}
''')


class StandIn(VllmServer):
    def __init__(self, script: str, mode: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.script, self.mode = script, mode

    def command(self) -> list[str]:
        return [sys.executable, self.script, str(self.port), self.mode]


@pytest.fixture
def standin(tmp_path) -> str:
    path = tmp_path / "standin.py"
    path.write_text(STANDIN)
    return str(path)


def _alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_gone(pids, timeout: float) -> list[int]:
    deadline = time.time() + timeout
    while _alive(pids) and time.time() < deadline:
        time.sleep(0.1)
    return _alive(pids)


def _worker_pid(log: Path) -> int:
    for line in log.read_text().splitlines():
        if line.startswith("worker "):
            return int(line.split()[1])
    raise AssertionError("stand-in wrote no worker pid:\n" + log.read_text())


def test_failed_start_reports_reason_and_leaves_no_process(standin, tmp_path):
    server = StandIn(standin, "fail", DeploymentSpec(start_timeout_s=30), log_dir=tmp_path)
    with pytest.raises(DeploymentError) as info:
        server.start()
    assert "exceeds the model's 1024" in info.value.reason and "exited with code 3" in info.value.reason
    assert "--- vLLM log" in str(info.value)
    worker = _worker_pid(server.log_path)  # its parent is gone; it must be too
    assert _wait_gone([worker], 5) == []
    assert not server.alive() and server.pids() == []


def test_start_timeout_leaves_no_process(standin, tmp_path):
    server = StandIn(standin, "slow", DeploymentSpec(start_timeout_s=2), log_dir=tmp_path)
    with pytest.raises(DeploymentError, match="did not become healthy within 2s"):
        server.start()
    assert _wait_gone([_worker_pid(server.log_path)], 5) == []


def test_stop_kills_the_group_even_when_sigterm_is_ignored(standin, tmp_path):
    server = StandIn(standin, "stubborn", DeploymentSpec(start_timeout_s=30), log_dir=tmp_path)
    with server:
        pids = server.pids()
        assert len(pids) == 2 and server.alive()
        watchdog = server._watchdog.pid
        t0 = time.time()
        server.stop(grace=0.5)
        assert time.time() - t0 < 5
    assert _wait_gone(pids + [watchdog], 3) == []


def test_restart_keeps_the_port(standin, tmp_path):
    server = StandIn(standin, "ok", DeploymentSpec(start_timeout_s=30), log_dir=tmp_path)
    with server:
        port, first = server.port, server.pids()
        server.restart()
        assert server.port == port and server.alive() and set(server.pids()).isdisjoint(first)
        assert _wait_gone(first, 3) == []


def _run_caller(tmp_path: Path, script: str, mode: str, after: str) -> tuple[subprocess.Popen, list[int]]:
    code = CALLER.format(tests=str(Path(__file__).parent), script=script, mode=mode, log_dir=str(tmp_path),
                         after=after)
    # A terminal's Ctrl-C: SIGINT at its default (a test run may have inherited it ignored, e.g. after
    # vLLM in-process, and a child started with SIGINT ignored never sees KeyboardInterrupt).
    caller = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids: list[int] = []
    for line in caller.stdout:
        if line.startswith("PIDS"):
            pids = [int(p) for p in line.split()[1:]]
            break
    assert pids, "caller never reported its server's pids"
    return caller, pids


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM],
                         ids=["SIGKILL", "SIGINT (Ctrl-C)", "SIGTERM"])
def test_interrupted_or_killed_caller_leaves_no_process(standin, tmp_path, sig):
    caller, pids = _run_caller(tmp_path, standin, "ok", "time.sleep(600)")
    assert len(_alive(pids)) == 2
    os.kill(caller.pid, sig)
    caller.wait(60)  # ~6 s normally; generous because CI shares 2 cores with whatever else runs
    # SIGKILL runs no Python in the caller: the watchdog does the work (SIGTERM, then the group is gone)
    assert _wait_gone(pids, 15) == [], f"left behind after {sig!r}"


def _default_signals():
    for sig in (signal.SIGTERM, signal.SIGHUP):  # as a shell starts it (a test run may inherit them ignored)
        signal.signal(sig, signal.SIG_DFL)


def test_signal_handlers_are_installed_by_the_cli_not_by_an_import(tmp_path):
    # A fresh interpreter: this test process may have run the CLI (which installs them) already.
    code = textwrap.dedent('''
        import signal
        from cartspec.serving import server
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "importing server.py took over SIGTERM"
        server.install_signal_handlers()
        server.install_signal_handlers()  # idempotent
        assert signal.getsignal(signal.SIGTERM) is signal.getsignal(signal.SIGHUP) is server._on_signal

        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        from typer.testing import CliRunner
        from cartspec.cli import app
        r = CliRunner().invoke(app, ["data", "--out", {out!r}, "--train", "1", "--dev", "1", "--test", "1"])
        assert r.exit_code == 0, r.output
        assert signal.getsignal(signal.SIGTERM) is server._on_signal, "the CLI did not install the handlers"
        print("ok")
    ''').format(out=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       preexec_fn=_default_signals)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_dropped_server_object_is_still_stopped_at_exit(standin, tmp_path):
    caller, pids = _run_caller(tmp_path, standin, "ok", "del server; import gc; gc.collect()")
    caller.wait(20)
    assert _wait_gone(pids, 10) == []


# --- the real engine -----------------------------------------------------------------
def _vllm_pids_of(port: int) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if str(port) in " ".join(p.info["cmdline"] or []):
            out.append(p.pid)
    return out


@pytest.mark.vllm
def test_vllm_rejected_config_leaves_no_process(tiny_llama_dir, tmp_path):
    # The tiny model has 1024 positions: vLLM rejects a longer context at engine set-up.
    spec = DeploymentSpec(model=str(tiny_llama_dir), max_model_len=999_999, enforce_eager=True,
                          start_timeout_s=300)
    server = VllmServer(spec, log_dir=tmp_path)
    with pytest.raises(DeploymentError) as info:
        server.start()
    assert "999999" in str(info.value) or "max_model_len" in str(info.value)
    assert _wait_gone(_vllm_pids_of(server.port), 10) == []


@pytest.mark.vllm
def test_vllm_caller_killed_mid_run_leaves_no_process(tiny_llama_dir, tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f'''
        import time
        from cartspec.serving.server import VllmServer
        from cartspec.serving.spec import DeploymentSpec
        if __name__ == "__main__":
            s = VllmServer(DeploymentSpec(model={str(tiny_llama_dir)!r}, enforce_eager=True, max_num_seqs=4,
                                          start_timeout_s=300), log_dir={str(tmp_path)!r}).start()
            print("PIDS", *s.pids(), flush=True)
            time.sleep(600)
    '''))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = []
    for line in caller.stdout:
        if line.startswith("PIDS"):
            pids = [int(p) for p in line.split()[1:]]
            break
    assert len(pids) >= 2, "expected the API server and at least one engine process"
    caller.kill()
    caller.wait(10)
    assert _wait_gone(pids, 30) == []


# Shaped like the log of the engine that died in session 3's paper study (c=32, T=0.5).
_DEAD_ENGINE_LOG = """\
(APIServer pid=1) WARNING 11-29 16:05:07 [system_utils.py:255] Found ulimit of 20000 and failed to automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too many open files`.
(APIServer pid=1) INFO 11-29 16:05:09 [api_server.py:1] Starting vLLM API server
(Worker pid=3) ERROR 11-29 16:07:38 [multiproc_executor.py:1063]     gen.set_offset(gen.get_offset() - 4)
(Worker pid=3) ERROR 11-29 16:07:38 [multiproc_executor.py:1063] RuntimeError: CPU Generator does not use offset
(EngineCore pid=2) ERROR 11-29 16:07:38 [core.py:1512] RuntimeError: Worker failed with error 'CPU Generator does not use offset', please check the stack trace above for the root cause
""" + "(APIServer pid=1) ERROR 11-29 16:12:57 [serving.py:929] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.\n" * 500


def test_a_dead_engine_is_reported_by_its_root_cause_not_by_what_followed():
    from cartspec.serving.server import root_cause

    assert root_cause(_DEAD_ENGINE_LOG) == "RuntimeError: CPU Generator does not use offset"
    assert root_cause("(APIServer pid=1) INFO ok\n" + _DEAD_ENGINE_LOG.splitlines()[-1]) is None


def test_sweep_reports_why_a_vllm_deployment_died(tmp_path):
    from cartspec.serving.endpoint import VllmEndpoint
    from cartspec.serving.spec import DeploymentSpec

    dep = VllmEndpoint(DeploymentSpec(name="x"), log_dir=tmp_path)
    dep.server.log_path.write_text(_DEAD_ENGINE_LOG)
    reason = dep.died_reason()
    assert "RuntimeError: CPU Generator does not use offset" in reason and str(dep.server.log_path) in reason
