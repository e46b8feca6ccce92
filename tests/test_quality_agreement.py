import json

import pytest

from cartspec.quality.agreement import _mcnemar_exact, compare
from cartspec.task.data import Request
from cartspec.task.generator import generate
from cartspec.task.schema import SCHEMAS, canonical_json


@pytest.fixture(scope="module")
def reqs():
    return generate("dev", 120)


def gold_text(r):
    return canonical_json(SCHEMAS[r.task].model_validate(r.gold))


def test_identical_replies_are_preserved(reqs):
    replies = [gold_text(r) for r in reqs]
    a = compare(reqs, replies, replies)
    assert a.exact_text == 1.0 and a.same_parsed == 1.0 and a.diff == 0.0
    assert a.verdict == "preserved" and a.mcnemar_p == 1.0


def test_reformatted_json_agrees_when_parsed(reqs):
    base = [gold_text(r) for r in reqs]
    cand = [json.dumps(json.loads(t), separators=(",", ":")) for t in base]
    a = compare(reqs, base, cand)
    assert a.exact_text < 0.1 and a.same_parsed == 1.0 and a.verdict == "preserved"


def test_broken_candidate_is_worse(reqs):
    base = [gold_text(r) for r in reqs]
    cand = [t if i % 3 else "{}" for i, t in enumerate(base)]
    a = compare(reqs, base, cand)
    assert a.diff == pytest.approx(-40 / 120)
    assert a.verdict == "worse" and a.mcnemar_p < 1e-6


def test_mcnemar_exact_values():
    assert _mcnemar_exact(0, 0) == 1.0
    assert _mcnemar_exact(5, 5) == 1.0
    assert _mcnemar_exact(0, 6) == pytest.approx(2 / 64)


def test_lengths_must_match(reqs):
    with pytest.raises(ValueError):
        compare(reqs, ["{}"], ["{}", "{}"])
