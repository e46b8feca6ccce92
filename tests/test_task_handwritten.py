"""The hand-written request set: shipped, loadable by name in the study and in draft acceptance, gold in the
task's canonical form, and none of it a generator's output."""

import json

from cartspec.draft.acceptance import load_data
from cartspec.task.generator import generate
from cartspec.task.request_sets import HANDWRITTEN, load_request_set
from cartspec.task.schema import SearchParams, canonical_dict


def test_the_handwritten_set_loads_by_name_with_canonical_gold_and_no_generated_query():
    assert HANDWRITTEN.is_file()
    study, acceptance = load_request_set("handwritten", 40), load_data("handwritten")
    assert [r.query for r in study] == [r.query for r in acceptance] and len(study) == 40
    assert len({r.query for r in study}) == 40
    for r in study:
        assert r.task == "search" and r.gold is not None
        assert canonical_dict(SearchParams(**r.gold)) == r.gold, r.id  # what the scorer compares against
        for turn in r.history[1::2]:  # an earlier reply in the history is a canonical reply too
            d = json.loads(turn.content)
            assert canonical_dict(SearchParams(**d)) == d, r.id
    assert sum(bool(r.history) for r in study) == 6
    generated = {r.query for split in ("train", "dev", "test") for r in generate(split, 400)}
    assert not generated & {r.query for r in study}
