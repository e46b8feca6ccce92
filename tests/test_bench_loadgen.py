"""The load generator's numbers, against a streaming server whose timing is known in advance."""

from __future__ import annotations

import asyncio

import pytest

from cartspec.bench.loadgen import ChatRequest, LoadConfig, record_from_events, run_load
from cartspec.results import PointConfig, PointResult
from cartspec.testing.trivial_server import FakeConfig, TrivialServer

MSG = [{"role": "user", "content": "red trail runners under $120"}]


def reqs(n: int, **fake) -> list[ChatRequest]:
    extra = {"cartspec_fake": fake} if fake else {}
    return [ChatRequest(messages=MSG, id=f"r{i}", max_tokens=64, extra=extra) for i in range(n)]


def run(url: str, requests, **cfg):
    return asyncio.run(run_load(url, "trivial", requests, LoadConfig(**cfg)))


def test_metrics_from_chunk_times_follow_the_definitions():
    # start at 10.0; content at +0.5, +0.6, +0.8, +1.1; the server reports 7 tokens (chunks carried several)
    rec = record_from_events("a", 10.0, [10.5, 10.6, 10.8, 11.1], {"completion_tokens": 7, "prompt_tokens": 30},
                             t_end=11.2)
    assert rec.ttft == pytest.approx(0.5)
    assert rec.e2el == pytest.approx(1.1)  # last content token, not the end of the stream
    assert rec.itl == pytest.approx([0.1, 0.2, 0.3])
    assert rec.tpot == pytest.approx((1.1 - 0.5) / 6)  # tokens from usage, not chunks
    assert rec.output_tokens == 7 and rec.chunks == 4 and rec.prompt_tokens == 30 and rec.ok


def test_without_usage_tokens_fall_back_to_chunks_and_one_token_has_no_tpot():
    rec = record_from_events("a", 0.0, [0.2, 0.3], None, 0.4)
    assert rec.output_tokens == 2 and not rec.usage_reported
    assert record_from_events("b", 0.0, [0.2], {"completion_tokens": 1}, 0.3).tpot is None


def test_ttft_tpot_itl_measured_against_a_paced_server():
    with TrivialServer(FakeConfig(tokens=11, ttft_s=0.10, itl_s=0.02)) as srv:
        res = run(srv.url, reqs(4), concurrency=1, n_requests=4)
    assert len(res.records) == 4
    # the server's pacing is a floor (a sleep never ends early); on two busy cores it may end late, so the
    # upper bounds are loose and the definitions are checked between the measured figures themselves
    for r in res.records:
        assert r.ok, r.error
        assert r.output_tokens == 11 and r.usage_reported and r.chunks == 11
        assert 0.095 <= r.ttft < 0.5
        assert len(r.itl) == 10 and sum(r.itl) >= 0.18  # one late read shortens the next gap, not the sum
        assert r.e2el == pytest.approx(r.ttft + sum(r.itl))  # the last token's arrival
        assert r.tpot == pytest.approx((r.e2el - r.ttft) / 10)  # one token a chunk: TPOT is the mean ITL
        assert 0.018 <= r.tpot < 0.06


def test_several_tokens_per_chunk_separates_itl_from_tpot():
    # Speculation delivers several accepted tokens in one chunk: ITL is per chunk, TPOT per token.
    with TrivialServer(FakeConfig(tokens=12, ttft_s=0.0, itl_s=0.03, tokens_per_chunk=3)) as srv:
        res = run(srv.url, reqs(2), concurrency=1, n_requests=2)
    # the pacing is a floor (on two busy cores a sleep may end late: it once measured 36 ms against 30 ± 6),
    # so the definitions are checked between the measured figures, with loose upper bounds
    for r in res.records:
        assert r.chunks == 4 and r.output_tokens == 12
        assert len(r.itl) == 3 and 0.027 <= sum(r.itl) / 3 < 0.1  # one gap a chunk
        assert r.e2el == pytest.approx(r.ttft + sum(r.itl))
        assert r.tpot == pytest.approx((r.e2el - r.ttft) / 11)  # a gap per token: 11 after the first
        assert r.tpot == pytest.approx(sum(r.itl) / 3 * 3 / 11)  # so TPOT is the chunk gap over its 3 tokens


def test_errors_are_recorded_and_counted_never_dropped():
    good, bad, broken = reqs(3), reqs(2, fail=True), reqs(2, tokens=10, abort_after=3)
    mixed = [good[0], bad[0], broken[0], good[1], bad[1], broken[1], good[2]]
    with TrivialServer(FakeConfig(tokens=5)) as srv:
        res = run(srv.url, mixed, concurrency=2, n_requests=7)
    assert len(res.records) == 7
    errors = sorted(r.error for r in res.records if not r.ok)
    assert len(errors) == 4
    assert [e[:8] for e in errors[:2]] == ["HTTP 500", "HTTP 500"]
    # a stream cut mid-way: httpx sees the broken chunked body, or the stream ends without [DONE]
    assert all("RemoteProtocolError" in e or "before [DONE]" in e for e in errors[2:]), errors
    point = PointResult.measured(PointConfig(deployment="x", method="none", concurrency=2, n_requests=7),
                                 res.records, res.wall_s, res.acceptance)
    assert point.n_requests == 7 and point.n_errors == 4
    assert point.output_tokens == 15  # only completed requests count
    assert point.slo_attainment == pytest.approx(3 / 7)


def test_unreachable_server_gives_error_records():
    res = asyncio.run(run_load("http://127.0.0.1:9", "m", reqs(3), LoadConfig(concurrency=1, n_requests=3)))
    assert len(res.records) == 3 and all(not r.ok for r in res.records)
    assert res.acceptance is None


def test_closed_loop_keeps_exactly_concurrency_in_flight():
    with TrivialServer(FakeConfig(tokens=5, itl_s=0.02)) as srv:
        res = run(srv.url, reqs(5), concurrency=4, n_requests=16)
        assert srv.counters.max_in_flight == 4
    assert len(res.records) == 16
    # output throughput uses the wall time of the whole run
    point = PointResult.measured(PointConfig(deployment="x", method="none", concurrency=4, n_requests=16),
                                 res.records, res.wall_s, res.acceptance)
    assert point.output_throughput == pytest.approx(16 * 5 / res.wall_s)


def test_warmup_is_excluded_from_records_and_counters():
    cfg = FakeConfig(tokens=8, accept_per_pos=(0.5, 0.25, 0.25))
    with TrivialServer(cfg) as srv:
        res = run(srv.url, reqs(6), concurrency=2, n_requests=5, warmup=3)
        assert srv.counters.requests == 8
    assert len(res.records) == 5 and res.n_warmup == 3
    drafts = 5 * 8 / 2.0  # tokens / (1 + sum(accept_per_pos)) per request
    assert res.acceptance.steps == pytest.approx(drafts)
    assert res.acceptance.rate == pytest.approx(1.0 / 3)
    assert res.acceptance.tau == pytest.approx(2.0)
    assert res.acceptance.per_position_rate == pytest.approx([0.5, 0.25, 0.25])


def test_open_loop_poisson_arrivals_do_not_wait_for_replies():
    with TrivialServer(FakeConfig(tokens=4, itl_s=0.05)) as srv:
        res = run(srv.url, reqs(4), mode="open", rate=40.0, n_requests=20, seed=1)
        assert srv.counters.max_in_flight > 1
    assert len(res.records) == 20 and all(r.ok for r in res.records)
    starts = [r.start for r in res.records]
    assert starts == sorted(starts) and starts[0] == 0.0
    assert 0.1 < starts[-1] < 1.5  # 19 gaps of mean 25 ms


def test_seeds_are_sent_only_when_sampling_and_can_be_turned_off():
    with TrivialServer(FakeConfig(tokens=2)) as srv:
        run(srv.url, reqs(3), n_requests=3, temperature=0.0)
        run(srv.url, reqs(3), n_requests=3, temperature=0.5, seed=1)
        run(srv.url, reqs(3), n_requests=3, temperature=0.5, seed=-1)
        seeds = srv.counters.seeds
    assert seeds[:3] == [None] * 3
    assert len(set(seeds[3:6])) == 3 and None not in seeds[3:6]  # one per request, the same on every deployment
    assert seeds[6:] == [None] * 3
