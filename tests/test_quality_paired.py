"""Paired structured tests on constructed data whose answer is known in advance."""

from __future__ import annotations

import pytest

from cartspec.quality.paired import paired_test, sign_test, verdict_for


def pairs(n: int, only_base: int, only_cand: int, both: int | None = None):
    """n requests, one pair each: ``only_base`` where only the baseline is right, ``only_cand`` where only the
    candidate is, the rest both right (or ``both`` of them, the others both wrong)."""
    base, cand = [], []
    for i in range(n):
        if i < only_base:
            base.append(1), cand.append(0)
        elif i < only_base + only_cand:
            base.append(0), cand.append(1)
        elif both is None or i < only_base + only_cand + both:
            base.append(1), cand.append(1)
        else:
            base.append(0), cand.append(0)
    return [f"r{i}" for i in range(n)], base, cand


def test_degraded_beyond_the_margin_is_worse():
    ids, a, b = pairs(400, only_base=44, only_cand=4)  # 10 points worse
    t = paired_test("exact_match", ids, a, b, margin=0.02)
    assert t.diff == pytest.approx(-0.10)
    assert t.verdict == "worse" and t.ci_high < -0.02
    assert t.needed_n is None
    assert t.p_value < 1e-6 and t.discordant == (44, 4)


def test_equal_candidate_is_preserved_at_sufficient_n_and_inconclusive_below_it():
    ids, a, b = pairs(100, only_base=3, only_cand=3, both=60)
    small = paired_test("exact_match", ids, a, b, margin=0.02)
    assert small.diff == 0 and small.verdict == "inconclusive"
    assert small.needed_n is not None and small.needed_n > 100
    # the same pattern at the requests the power calculation asked for: now conclusive
    reps = -(-small.needed_n // 100)
    ids2 = [f"{k}-{i}" for k in range(reps) for i in ids]
    big = paired_test("exact_match", ids2, a * reps, b * reps, margin=0.02)
    assert big.verdict == "preserved"
    assert -0.02 < big.ci_low <= 0 <= big.ci_high < 0.02


def test_small_degradation_is_inconclusive_with_a_sample_size_estimate():
    ids, a, b = pairs(200, only_base=6, only_cand=4)  # 1 point worse, within the margin, too few requests
    t = paired_test("exact_match", ids, a, b, margin=0.02)
    assert t.verdict == "inconclusive"
    assert t.ci_low < -0.02 < t.ci_high
    assert t.needed_n > 200 and t.needed_samples > 1


def test_identical_replies_do_not_give_a_zero_width_interval():
    """No discordance among 64 requests cannot exclude a few points of difference (rule of three)."""
    ids, a, b = pairs(64, 0, 0)
    t = paired_test("exact_match", ids, a, b, margin=0.02)
    assert t.ci_low < -0.02 and t.ci_high > 0.02 and t.verdict == "inconclusive"
    assert 150 <= t.needed_n <= 400
    ids, a, b = pairs(1000, 0, 0)
    assert paired_test("exact_match", ids, a, b, margin=0.02).verdict == "preserved"


def test_clusters_are_resampled_whole():
    """The same request answered at 10 loads is one unit, not ten: copies do not narrow the interval."""
    ids, a, b = pairs(60, only_base=4, only_cand=4)
    one = paired_test("exact_match", ids, a, b)
    copies = paired_test("exact_match", ids * 10, a * 10, b * 10, samples=[0] * 600)
    assert copies.requests == 60 and copies.pairs == 600
    assert copies.ci_high - copies.ci_low == pytest.approx(one.ci_high - one.ci_low, rel=0.25)
    # ten independent samples per request (different sample indices) do count
    samples = paired_test("exact_match", [i for i in ids for _ in range(10)],
                          [x for x in a for _ in range(10)], [x for x in b for _ in range(10)],
                          samples=[j for _ in ids for j in range(10)])
    assert samples.samples == 10


def test_continuous_metric_and_verdict_edges():
    ids = [f"r{i}" for i in range(500)]
    a = [0.8] * 500
    b = [0.8 + (0.01 if i % 2 else -0.01) for i in range(500)]
    t = paired_test("field_accuracy", ids, a, b, margin=0.02)
    assert t.verdict == "preserved" and abs(t.diff) < 1e-9
    assert verdict_for(-0.01, 0.01, 0.02) == "preserved"
    assert verdict_for(-0.05, -0.03, 0.02) == "worse"
    assert verdict_for(0.03, 0.05, 0.02) == "inconclusive"  # better by more than the margin: not equivalent
    assert verdict_for(-0.03, 0.01, 0.02) == "inconclusive"
    better = paired_test("exact_match", *pairs(400, only_base=4, only_cand=44)[0:3])
    assert better.verdict == "inconclusive" and "better" in better.note


def test_sign_test_and_bad_input():
    assert sign_test(0, 0) == 1.0
    assert sign_test(10, 0) == pytest.approx(2 / 2 ** 10)
    assert sign_test(5, 5) == 1.0
    with pytest.raises(ValueError):
        paired_test("exact_match", [], [], [])
    with pytest.raises(ValueError):
        paired_test("exact_match", ["a"], [1], [1], margin=0)
