"""Reading vLLM's speculative-decoding counters from /metrics."""

from __future__ import annotations

import pytest

from cartspec.bench.metrics import SpecCounters, parse_prometheus, stats_from_responses

# Shaped like vLLM 0.32's exposition (counters get _total and _created series).
BEFORE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="cartspec"} 100.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="cartspec"} 1.764e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="cartspec"} 300.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="cartspec"} 90.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="cartspec",position="0"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="cartspec",position="1"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="cartspec",position="2"} 10.0
vllm:num_requests_running{engine="0",model_name="cartspec"} 0.0
"""

AFTER = BEFORE.replace("} 100.0", "} 300.0").replace("} 300.0\nvllm:spec_decode_num_accepted_tokens_total",
                                                     "} 900.0\nvllm:spec_decode_num_accepted_tokens_total") \
    .replace("} 90.0", "} 330.0").replace('"0"} 50.0', '"0"} 170.0').replace('"1"} 30.0', '"1"} 110.0') \
    .replace('"2"} 10.0', '"2"} 50.0')


def test_parse_skips_comments_and_created_series():
    names = [n for n, _, _ in parse_prometheus(BEFORE)]
    assert "vllm:spec_decode_num_drafts_created" not in names
    assert names.count("vllm:spec_decode_num_accepted_tokens_per_pos_total") == 3
    labels = parse_prometheus(BEFORE)[-2][1]
    assert labels == {"engine": "0", "model_name": "cartspec", "position": "2"}


def test_delta_gives_acceptance_tau_and_per_position():
    before, after = SpecCounters.from_text(BEFORE), SpecCounters.from_text(AFTER)
    assert after.drafts == 300 and after.draft_tokens == 900 and after.accepted == 330
    stats = (after - before).stats()
    # over the point: 200 drafts, 600 draft tokens, 240 accepted (120, 80, 40 by position)
    assert stats.rate == pytest.approx(240 / 600)
    assert stats.tau == pytest.approx(1 + 240 / 200)
    assert stats.per_position_rate == pytest.approx([0.6, 0.4, 0.2])


def test_engines_are_summed():
    two = BEFORE + BEFORE.replace('engine="0"', 'engine="1"')
    c = SpecCounters.from_text(two)
    assert c.drafts == 200 and c.per_pos[0] == 100


def test_a_server_without_speculation_has_no_stats():
    plain = 'vllm:num_requests_running{engine="0"} 1.0\n'
    c = SpecCounters.from_text(plain)
    assert not c.present and (c - c).stats() is None
    # speculating but idle during the point: no drafts, no rate to report
    idle = SpecCounters.from_text(BEFORE)
    assert (idle - idle).stats() is None


def test_per_request_metrics_fallback():
    stats = stats_from_responses([
        {"num_spec_steps": 10, "num_draft_tokens": 30, "num_accepted_draft_tokens": 12},
        {"num_spec_steps": 10, "num_draft_tokens": 30, "num_accepted_draft_tokens": 8}, None])
    assert stats.rate == pytest.approx(20 / 60) and stats.tau == pytest.approx(2.0)
    assert stats.source == "responses"
    assert stats_from_responses([]) is None


def test_an_offline_engines_metrics_give_the_same_counters():
    """``LLM.get_metrics()`` of an offline engine (vLLM's own metric types), two engines' series summed."""
    pytest.importorskip("vllm")
    from vllm.v1.metrics.reader import Counter, Gauge, Vector

    def snapshot(drafts, tokens, accepted, per_pos):
        return [Counter("vllm:spec_decode_num_drafts", {}, drafts),
                Counter("vllm:spec_decode_num_draft_tokens", {}, tokens),
                Counter("vllm:spec_decode_num_accepted_tokens", {}, accepted),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {"engine": "0"}, per_pos[:2]),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {"engine": "1"}, per_pos[2:]),
                Gauge("vllm:num_requests_running", {}, 3)]

    before = SpecCounters.from_vllm_metrics(snapshot(10, 30, 12, [6, 4, 1, 1]))
    after = SpecCounters.from_vllm_metrics(snapshot(30, 90, 45, [20, 14, 6, 5]))
    st = (after - before).stats()
    assert (st.steps, st.drafted, st.accepted) == (20, 60, 33)
    assert st.per_position == [19, 14] and st.tau == pytest.approx(1 + 33 / 20)
    assert SpecCounters.from_vllm_metrics([Gauge("vllm:num_requests_running", {}, 1)]).stats() is None
