"""What the agent and its engines write besides traffic is its owner's only: the trace, the vLLM logs (a
``serve``'s and a study's), an owned agent's log. Directories 0700, files 0600, never written through a
symlink; a directory another user could write is refused, and ``cartspec serve`` says so without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cartspec.agent.config import AgentConfig
from cartspec.agent.process import AgentProcess
from cartspec.agent.trace import TraceRecord, TraceWriter, read_trace
from cartspec.private_files import UnsafePathError
from cartspec.serving.server import DeploymentError
from cartspec.serving.spec import DeploymentSpec
from test_private_files import _mode, open_umask  # noqa: F401 (a fixture)
from test_serving_cleanup import STANDIN, StandIn


@pytest.fixture
def standin(tmp_path) -> str:
    path = tmp_path / "standin.py"
    path.write_text(STANDIN)
    return str(path)


def _open_dir(path: Path) -> Path:
    path.mkdir()
    path.chmod(0o777)
    return path


# --- the trace ------------------------------------------------------------------------------------------------

def test_the_trace_and_its_rotation_are_owner_only(tmp_path, open_umask):
    path = tmp_path / "runs" / "agent" / "trace.jsonl"
    records = [TraceRecord(id=f"t{i}", endpoint="/v1/search", status=200, reason="x" * 100) for i in range(3)]
    w = TraceWriter(path, max_bytes=len(records[0].model_dump_json(exclude_none=True)) * 3 // 2)
    for r in records:  # the second line takes it past max_bytes: rotated to trace.jsonl.1
        w.write(r)
    w.close()
    rotated = path.with_name("trace.jsonl.1")
    assert [r["id"] for r in read_trace(rotated)] == ["t0", "t1"] and [r["id"] for r in read_trace(path)] == ["t2"]
    assert _mode(path) == _mode(rotated) == 0o600
    assert _mode(path.parent) == _mode(path.parent.parent) == 0o700  # created: 0700, parents too


def test_a_trace_beside_other_things_tightens_the_file_not_their_directory(tmp_path):
    shared = tmp_path / "project"
    shared.mkdir(mode=0o755)
    old = shared / "trace.jsonl"
    old.write_text('{"id": "before"}\n')
    old.chmod(0o644)
    TraceWriter(old).close()
    assert _mode(old) == 0o600 and _mode(shared) == 0o755


def test_a_symlink_in_the_traces_place_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me")
    link = tmp_path / "trace.jsonl"
    link.symlink_to(target)
    with pytest.raises(UnsafePathError, match=r"cannot write the trace to .*trace\.jsonl.*symlink"):
        TraceWriter(link)
    assert target.read_text() == "keep me"


def test_a_trace_directory_others_can_write_is_refused(tmp_path):
    d = _open_dir(tmp_path / "open")
    with pytest.raises(UnsafePathError, match="cannot write the trace to .*chmod go-w"):
        TraceWriter(d / "trace.jsonl")
    assert list(d.iterdir()) == []


# --- vLLM logs ----------------------------------------------------------------------------------------------

def test_vllm_logs_are_owner_only(standin, tmp_path, open_umask):
    logs = tmp_path / "study" / "logs"  # a study's logs/ goes through the same server class as serve's
    logs.parent.mkdir()
    logs.mkdir(mode=0o755)
    server = StandIn(standin, "ok", DeploymentSpec(start_timeout_s=30), log_dir=logs)
    with server:
        assert server.alive()
    assert _mode(logs) == 0o700 and _mode(server.log_path) == 0o600
    assert server.log_path.read_text().startswith("$ ")


def test_a_symlink_in_the_logs_place_fails_the_start_and_its_target_is_untouched(standin, tmp_path):
    server = StandIn(standin, "ok", DeploymentSpec(start_timeout_s=30), log_dir=tmp_path)
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    server.log_path.symlink_to(target)
    with pytest.raises(DeploymentError, match=r"cannot write the vLLM log .*symlink"):
        server.start()
    assert target.read_text() == "keep me" and server.proc is None  # nothing started


def test_a_log_directory_others_can_write_fails_the_start_with_what_to_do(standin, tmp_path):
    d = _open_dir(tmp_path / "logs")
    server = StandIn(standin, "ok", DeploymentSpec(start_timeout_s=30), log_dir=d)
    with pytest.raises(DeploymentError, match="cannot write the vLLM log .*chmod go-w"):
        server.start()
    assert server.proc is None and list(d.iterdir()) == []


# --- an owned agent's log -------------------------------------------------------------------------------------

class StandInAgent(AgentProcess):
    """``AgentProcess`` on the stand-in server (it answers /ready like the agent)."""

    def __init__(self, script: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.script = script

    def command(self) -> list[str]:
        return [sys.executable, self.script, str(self.config.port), "ok"]


def test_an_owned_agents_directory_and_log_are_owner_only(standin, tmp_path, open_umask):
    out = tmp_path / "runs" / "agent"
    with StandInAgent(standin, AgentConfig(), out_dir=out) as agent:
        assert agent.alive()
    assert _mode(out) == 0o700 and _mode(agent.log_path) == 0o600


# --- cartspec serve -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--record-traffic", "--trace"])
def test_serve_refuses_a_directory_others_can_write_without_a_traceback(tmp_path, flag):
    from test_agent_app import FakeUpstream

    d = _open_dir(tmp_path / "open")
    value = d if flag == "--record-traffic" else d / "trace.jsonl"
    fake = FakeUpstream().start()
    try:
        run = subprocess.run([sys.executable, "-m", "cartspec.cli", "serve", "--upstream", fake.url,
                              "--label", "ngram-g3", flag, str(value)],
                             capture_output=True, text=True, timeout=60)
    finally:
        fake.stop()
    out = " ".join((run.stdout + run.stderr).split())  # the console wraps long lines
    assert run.returncode == 2, out
    assert "error:" in out and "can be written by other users" in out and "chmod go-w" in out, out
    assert "Traceback" not in out, out
    assert list(d.iterdir()) == []
