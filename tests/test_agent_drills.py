"""The agent drills (``benchmarks/agent_*_drill.py``) as tests, and the owner of the agent process they use.

The drills' own checks (fault: every phase answered as it should and the agent never crashed; fallback:
traffic left a draft that stopped paying and came back; admission: overload refused early, with
Retry-After) start real vLLM deployments and load them for a minute or more: they run on request, with
CARTSPEC_HEAVY_TESTS=1, one at a time on a shared machine (``flock /tmp/cartspec-heavy.lock``). The light
tests here run the admission drill against a scripted upstream, so the drills' plumbing (the agent
process, the closed loop, the summaries) is checked in every run, and the agent process's owner.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from cartspec.agent.config import AgentConfig
from cartspec.agent.process import AgentError, AgentProcess
from test_agent_app import SEARCH_JSON, FakeUpstream

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

SUPPORT_JSON = '{"intent": "support", "topic": "order_status", "reply": "It ships tomorrow."}'

HEAVY = [pytest.mark.vllm, pytest.mark.timeout(1200), pytest.mark.skipif(
    os.environ.get("CARTSPEC_HEAVY_TESTS") != "1",
    reason="a drill starts real vLLM deployments and loads them for a minute or more; "
           "run with CARTSPEC_HEAVY_TESTS=1 (under flock /tmp/cartspec-heavy.lock)")]


def heavy(test):
    for mark in HEAVY:
        test = mark(test)
    return test


def _by_task(body: dict) -> str:
    """A well-formed reply for whichever task the agent asked (its schema names it)."""
    return SUPPORT_JSON if "support" in json.dumps(body.get("response_format") or body.get("messages")[:1]) \
        else SEARCH_JSON


@pytest.fixture
def upstream():
    fake = FakeUpstream()
    fake.reply = _by_task
    fake.start()
    yield fake
    fake.stop()


def test_the_agent_process_answers_and_leaves_nothing_behind(upstream, tmp_path):
    agent = AgentProcess(AgentConfig(trace_path=None), ["--upstream", upstream.url, "--label", "eagle3-domain-g3"],
                         tmp_path, name="a")
    with agent:
        assert agent.alive() and agent.url.startswith("http://127.0.0.1:")
        r = httpx.post(agent.url + "/v1/search", json={"query": "red running shoes"})
        assert r.status_code == 200 and r.headers["x-cartspec-deployment"] == "eagle3-domain-g3"
        pids = agent.pids()
        assert pids
    assert not agent.alive() and agent.pids() == []
    assert (tmp_path / "a.yaml").exists() and "serve --config" in (tmp_path / "a.log").read_text()


def test_an_agent_that_cannot_start_says_why(tmp_path):
    agent = AgentProcess(AgentConfig(), ["--spec", str(tmp_path / "missing.yaml")], tmp_path, start_timeout_s=50)
    with pytest.raises(AgentError) as info:
        agent.start()
    assert "exited with code 2" in info.value.reason and "missing.yaml" in info.value.reason, info.value
    assert not agent.alive() and agent.pids() == []


def test_the_admission_drill_runs_against_a_scripted_upstream(upstream, tmp_path):
    import agent_admission_drill as drill

    report = drill.run(drill.parse_args(["--url", upstream.url, "--label", "eagle3-domain-g3", "--clients", "4",
                                         "--duration", "2", "--warmup-s", "0", "--out", str(tmp_path)]))
    adm = report["modes"]["admission"]
    assert report["passed"], report["checks"]
    assert adm["requests"] > 10 and adm["fresh_answers"]["p50_s"] is not None
    rows = [json.loads(line) for line in (tmp_path / "requests-admission.jsonl").read_text().splitlines()]
    assert len(rows) == adm["requests"] and {r["endpoint"] for r in rows} == {"search", "support"}


def _checks_hold(report: dict) -> None:
    failed = [name for name, ok in report["checks"].items() if not ok]
    assert not failed, f"failed: {failed}; summary: {json.dumps(report, indent=1)[:4000]}"


@heavy
def test_fault_drill_every_phase_answers_as_it_should(tmp_path):
    """vLLM SIGKILLed under load and restarted: valid requests 2xx before, 503 with a reason while it is down,
    2xx again after; invalid ones 4xx throughout; the agent never crashes."""
    import agent_fault_drill as drill

    _checks_hold(drill.run(drill.parse_args(["--enforce-eager", "--clients", "16", "--duration", "40",
                                             "--kill-at", "10", "--out", str(tmp_path)])))


@heavy
def test_fallback_drill_leaves_a_draft_that_stopped_paying_and_comes_back(tmp_path):
    import agent_fallback_drill as drill

    _checks_hold(drill.run(drill.parse_args(["--enforce-eager", "--hold-s", "10", "--after-s", "10",
                                             "--out", str(tmp_path)])))


@heavy
def test_admission_drill_refuses_early_under_overload(tmp_path):
    import agent_admission_drill as drill

    _checks_hold(drill.run(drill.parse_args(["--enforce-eager", "--duration", "40", "--out", str(tmp_path)])))
