"""Admission control: under overload a fast 503 with Retry-After, not a late answer for everyone.

Unit tests of the estimate (Little's law over completions per busy second) on
a fake clock, then the app against a fake upstream that serves one call at a
time, so a queue builds exactly as on a saturated deployment.
"""

from __future__ import annotations

import threading
import time

import pytest

from cartspec.agent import AgentConfig
from cartspec.agent.admission import Admission, Estimate, Throughput
from cartspec.agent.config import AdmissionConfig
from cartspec.agent.trace import read_trace
from test_agent_app import make_client, post, upstream  # noqa: F401 - upstream is a fixture


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def serve_calls(tp: Throughput, clock: Clock, n: int, service_s: float, gap_s: float = 0.0) -> None:
    """``n`` calls one after another, each ``service_s`` long, ``gap_s`` idle between them."""
    for _ in range(n):
        tp.begin()
        clock.t += service_s
        tp.end()
        clock.t += gap_s


# --- the estimate --------------------------------------------------------------------
def test_throughput_counts_busy_seconds_so_light_traffic_is_not_mistaken_for_slow_service():
    clock = Clock()
    tp = Throughput(clock=clock)
    serve_calls(tp, clock, 5, service_s=0.5, gap_s=9.5)  # one request every 10 s, each 0.5 s
    assert tp.rate() == pytest.approx(2.0)  # 2 per busy second, not 0.1 per wall second


def test_throughput_of_overlapping_calls_and_of_a_stall():
    clock = Clock()
    tp = Throughput(clock=clock)
    for _ in range(4):  # 4 calls in flight together, all done after 2 s: 2 per second...
        tp.begin()
    clock.t += 2.0
    for _ in range(4):
        tp.end()
    for _ in range(4):
        tp.begin()
    clock.t += 2.0
    for _ in range(4):
        tp.end()
    assert tp.rate() == pytest.approx(7 / 2.0)  # completions after the first, over the busy time since it
    tp.begin()  # ...then the deployment stalls with work: the rate falls without waiting for a completion
    clock.t += 5.0
    assert tp.rate() == pytest.approx(7 / 7.0)


def test_throughput_forgets_old_completions_and_failed_calls_do_not_count():
    clock = Clock()
    tp = Throughput(window_s=30, clock=clock)
    serve_calls(tp, clock, 3, service_s=1.0)
    tp.begin()
    clock.t += 1.0
    tp.end(completed=False)  # refused at once or failed: no measure of how fast replies come
    assert tp.rate() == pytest.approx(2 / 3.0)
    clock.t += 31
    assert tp.rate() is None


def test_idle_deployment_always_admits_even_when_last_measured_slow():
    adm = Admission(AdmissionConfig(enabled=True, max_wait_s=0.01))
    v = adm.check(Estimate(queued=0, inflight=0, rate=0.001))
    assert v.admit


def test_unmeasured_deployment_admits():
    adm = Admission(AdmissionConfig(enabled=True, max_wait_s=2.0))
    assert adm.check(Estimate(queued=500, inflight=64, rate=None)).admit


def test_long_queue_with_slow_service_is_refused_with_retry_after_and_reason():
    adm = Admission(AdmissionConfig(enabled=True, max_wait_s=2.0, retry_after_s=1.0))
    v = adm.check(Estimate(queued=30, inflight=34, rate=5.0), "speculative (eagle3-domain-g3)")
    assert not v.admit
    assert v.estimate.expected_s == pytest.approx(13.0)  # (64 + itself) / 5: Little's law
    assert v.retry_after_s == 11  # the excess over the bound drains at the measured rate
    assert "13.0s" in v.reason and "30 queued" in v.reason and "34 in flight" in v.reason
    assert "2s bound" in v.reason and "eagle3-domain-g3" in v.reason


def test_load_within_the_bound_is_admitted_and_retry_after_has_a_floor():
    adm = Admission(AdmissionConfig(enabled=True, max_wait_s=2.0, retry_after_s=3.0))
    assert adm.check(Estimate(queued=0, inflight=9, rate=5.0)).admit  # 10 / 5 = 2.0 s
    v = adm.check(Estimate(queued=0, inflight=10, rate=5.0))  # 2.2 s
    assert not v.admit and v.retry_after_s == 3


def test_admission_is_off_by_default():
    assert AgentConfig().admission.enabled is False
    assert AdmissionConfig().max_wait_s == 2.0


# --- through the app ----------------------------------------------------------------------
def _busy(client, n: int, statuses: list) -> list[threading.Thread]:
    def one(i):
        statuses.append(post(client, "/v1/search", {"query": f"slow {i}"}).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _wait_for(cond, timeout=10.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.01)


def test_overloaded_agent_answers_503_with_retry_after_while_cache_hits_and_idle_pass(upstream, tmp_path):
    upstream.delay_s = 0.5
    admission = AdmissionConfig(enabled=True, max_wait_s=0.8, min_completions=2)
    # one call at a time: the rest wait in the agent's queue, as on a saturated deployment
    with make_client(upstream, tmp_path, admission=admission, max_inflight=1) as c:
        for q in ("red shoes", "blue shoes"):  # measure: ~2 completions per busy second
            assert post(c, "/v1/search", {"query": q}).status_code == 200
        up = c.app.state.agent.upstreams["speculative"]
        statuses: list[int] = []
        threads = _busy(c, 3, statuses)
        # the first finds the deployment idle: admitted; the next would take ~1 s (two calls at ~2/s): refused
        _wait_for(lambda: up.inflight + up.waiting + statuses.count(503) >= 3)
        assert statuses.count(503) >= 1

        r = post(c, "/v1/search", {"query": "red shoes"})
        assert r.status_code == 200 and r.headers["x-cartspec-cache"] == "hit"  # never waits: always served

        r = post(c, "/v1/search", {"query": "green shoes"})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "overloaded" and "over the 0.8s bound" in err["reason"]
        assert "queued" in err["reason"] and err["request_id"] == r.headers["x-request-id"]
        assert int(r.headers["retry-after"]) >= 1

        for t in threads:
            t.join(10)
        assert statuses.count(200) >= 1  # the ones already admitted are served
        assert up.inflight + up.waiting == 0
        r = post(c, "/v1/search", {"query": "green shoes"})  # idle again: admitted
        assert r.status_code == 200

        m = c.get("/metrics").text
        refused = 1 + statuses.count(503)
        assert f'cartspec_agent_admission_rejected_total{{endpoint="search",target="speculative"}} {refused}.0' in m
        assert 'cartspec_agent_requests_total{endpoint="search",status="503"}' in m
        assert 'cartspec_agent_admission_expected_seconds{target="speculative"}' in m
    trace = read_trace(tmp_path / "trace.jsonl")
    refusal = next(t for t in trace if t.get("error") == "overloaded")
    assert refusal["status"] == 503 and refusal["admission"]["admitted"] is False
    assert refusal["admission"]["expected_s"] > 0.8 and refusal["admission"]["queued"] + \
        refusal["admission"]["inflight"] >= 1
    assert trace[0]["admission"] == {"admitted": True, "queued": 0, "inflight": 0}  # first: nothing measured
    hit = next(t for t in trace if t.get("cache") == "hit")
    assert "admission" not in hit and hit["status"] == 200
    assert len(upstream.bodies) == 2 + statuses.count(200) + 1


def test_without_admission_the_same_overload_waits_instead(upstream, tmp_path):
    upstream.delay_s = 0.3
    with make_client(upstream, tmp_path, max_inflight=1) as c:
        for q in ("red shoes", "blue shoes"):
            post(c, "/v1/search", {"query": q})
        up = c.app.state.agent.upstreams["speculative"]
        statuses: list[int] = []
        threads = _busy(c, 3, statuses)
        _wait_for(lambda: up.inflight + up.waiting >= 3)
        t0 = time.perf_counter()
        assert post(c, "/v1/search", {"query": "green shoes"}).status_code == 200
        assert time.perf_counter() - t0 > 0.5  # late, not refused
        for t in threads:
            t.join(10)
    assert "admission" not in read_trace(tmp_path / "trace.jsonl")[0]
