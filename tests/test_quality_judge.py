"""The pairwise judge's protocol with scripted judges (a fake OpenAI server), and its calibration."""

from __future__ import annotations

import pytest

from cartspec.quality.judge import (JudgeSetup, calibrate, calibration_items, combine, corrupt, judge_messages,
                                    judge_sync, read_choice)
from cartspec.serving.client import ChatClient
from cartspec.task.generator import generate
from cartspec.testing.trivial_server import FakeConfig, TrivialServer


def _lines(body: dict) -> dict[str, str]:
    text = body["messages"][-1]["content"]
    return dict(ln.split(": ", 1) for ln in text.splitlines()
                if ln.startswith(("Answer A: ", "Answer B: ", "Correct answer: ")))


def oracle(body: dict) -> str:
    """A judge that knows: the answer equal to the reference wins, equal answers tie."""
    seen = _lines(body)
    a, b, ref = seen["Answer A"], seen["Answer B"], seen.get("Correct answer")
    if a == b:
        return "C"
    return "A" if a == ref else "B" if b == ref else "C"


def always_a(body: dict) -> str:
    return "A"  # pure position bias


def client_for(srv):
    return lambda: ChatClient(srv.url, "trivial")


def test_combine_both_orders():
    # first order: the candidate is A; second order: the candidate is B
    assert combine("A", "B") == ("win", True)
    assert combine("B", "A") == ("loss", True)
    assert combine("C", "C") == ("tie", True)
    assert combine("A", "A") == ("tie", False)  # the same position both times: inconsistent -> tie
    assert combine("B", "B") == ("tie", False)
    assert combine("A", "C") == ("tie", False)
    assert combine(None, "B") == ("tie", False)


def test_read_choice_prefers_logprobs_over_text():
    raw = {"choices": [{"logprobs": {"content": [{"token": "The", "logprob": -0.1, "top_logprobs": [
        {"token": "The", "logprob": -0.1}, {"token": " B", "logprob": -1.5}, {"token": "A", "logprob": -2.0}]}]}}]}
    assert read_choice(raw, "The") == "B"
    assert read_choice({"choices": [{}]}, " a, because") == "A"
    assert read_choice({"choices": [{}]}, "Neither") is None


def test_prompt_holds_both_answers_and_the_reference_only_in_reference_mode():
    req = generate("test", 5)[0]
    plain = judge_messages(req, "X1", "Y2")[-1]["content"]
    ref = judge_messages(req, "X1", "Y2", reference="GOLD")[-1]["content"]
    assert "Answer A: X1" in plain and "Answer B: Y2" in plain and "GOLD" not in plain
    assert "Correct answer: GOLD" in ref and req.query in ref


def test_each_pair_is_judged_in_both_orders_and_inconsistency_is_a_tie():
    reqs = generate("test", 3)
    items = [(r, f"cand-{i}", f"base-{i}", None) for i, r in enumerate(reqs)]
    with TrivialServer(FakeConfig(answer=always_a)) as srv:
        judged = judge_sync(client_for(srv), items)
        assert srv.counters.requests == 2 * len(items)
    assert [j.outcome for j in judged] == ["tie"] * 3
    assert not any(j.consistent for j in judged) and all(j.picks == ("A", "A") for j in judged)

    def prefers_candidate(body):
        s = _lines(body)
        return "A" if s["Answer A"].startswith("cand") else "B"

    with TrivialServer(FakeConfig(answer=prefers_candidate)) as srv:
        judged = judge_sync(client_for(srv), items)
    assert [j.outcome for j in judged] == ["win"] * 3 and all(j.consistent for j in judged)


def test_calibration_of_a_knowing_judge_and_of_a_biased_one():
    setup = JudgeSetup(url="http://unused", mode="reference", calibration_per_kind=3)
    with TrivialServer(FakeConfig(answer=oracle)) as srv:
        good = calibrate(client_for(srv), setup)
    assert good.accuracy == 1.0 and good.position_consistency == 1.0 and good.tie_rate == 0.0 and good.reliable
    assert set(good.by_kind) == {"price_changed", "brand_exclusion_dropped", "colour_swapped",
                                 "refund_window_wrong", "order_id_wrong", "identical"}
    with TrivialServer(FakeConfig(answer=always_a)) as srv:
        bad = calibrate(client_for(srv), setup)
    # every verdict is a tie: right only on the identical pairs (3 of 18)
    assert bad.accuracy == pytest.approx(3 / 18) and bad.position_consistency == 0.0
    assert bad.tie_rate == 1.0 and not bad.reliable


def test_corruptions_change_what_they_say():
    items = calibration_items(4)
    for kind, req, gold, other in items:
        assert (gold == other) == (kind == "identical")
    req = next(r for r in generate("test", 400) if r.task == "support" and (r.gold or {}).get("order_id"))
    bad = corrupt("order_id_wrong", req)
    assert req.gold["order_id"] not in bad
    assert corrupt("colour_swapped", req) is None  # a support reply has no colours


def test_failing_judge_is_an_error_not_a_tie():
    from cartspec.quality.judge import JudgeFailed

    items = [(r, "a", "b", None) for r in generate("test", 3)]
    with TrivialServer(FakeConfig(answer=always_a)) as srv:
        url = srv.url
    with pytest.raises(JudgeFailed, match="judge calls failed"):
        judge_sync(lambda: ChatClient(url, "trivial", timeout=2), items)


def test_setup_rejects_unknown_mode():
    with pytest.raises(ValueError, match="judge mode"):
        JudgeSetup(mode="vibes")
