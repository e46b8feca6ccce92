import json

import pytest

from cartspec.quality.agreement import compare
from cartspec.quality.paired import sign_test
from cartspec.task.data import Request
from cartspec.task.generator import generate
from cartspec.task.schema import SCHEMAS, canonical_json


@pytest.fixture(scope="module")
def reqs():
    return generate("dev", 120)


def gold_text(r):
    return canonical_json(SCHEMAS[r.task].model_validate(r.gold))


def test_identical_replies_are_preserved_within_what_the_sample_can_show(reqs):
    replies = [gold_text(r) for r in reqs]
    a = compare(reqs, replies, replies)
    assert a.exact_text == 1.0 and a.same_parsed == 1.0 and a.diff == 0.0 and a.mcnemar_p == 1.0
    # no discordant pair among 120 still allows a difference of about 3/120 (the rule of three), not [0, 0]
    lo, hi = a.diff_ci95
    assert -0.04 < lo < -0.01 and 0.01 < hi < 0.04
    assert a.verdict == "inconclusive"  # against a 2-point margin
    assert compare(reqs, replies, replies, margin=0.05).verdict == "preserved"


def test_reformatted_json_agrees_when_parsed(reqs):
    base = [gold_text(r) for r in reqs]
    cand = [json.dumps(json.loads(t), separators=(",", ":")) for t in base]
    a = compare(reqs, base, cand, margin=0.05)
    assert a.exact_text < 0.1 and a.same_parsed == 1.0 and a.verdict == "preserved"


def test_broken_candidate_is_worse(reqs):
    base = [gold_text(r) for r in reqs]
    cand = [t if i % 3 else "{}" for i, t in enumerate(base)]
    a = compare(reqs, base, cand)
    assert a.diff == pytest.approx(-40 / 120)
    assert a.verdict == "worse" and a.mcnemar_p < 1e-6


def test_mcnemar_exact_values():
    assert sign_test(0, 0) == 1.0
    assert sign_test(5, 5) == 1.0
    assert sign_test(0, 6) == pytest.approx(2 / 64)


def test_lengths_must_match(reqs):
    with pytest.raises(ValueError):
        compare(reqs, ["{}"], ["{}", "{}"])
