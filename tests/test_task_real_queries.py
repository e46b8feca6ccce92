"""Real shoppers' queries (WANDS): shipped with their licence, loadable by name in the study and in draft
acceptance, split into a recorded part and a held-out part that never meet, and none of them a query the
bundled drafters were trained on."""

import pytest

from cartspec.draft.acceptance import load_data
from cartspec.task.generator import DEFAULT_SIZES, generate
from cartspec.task.request_sets import REAL, REAL_TRAFFIC, load_request_set, real_requests


def test_the_real_queries_load_by_name_in_two_disjoint_parts_with_their_licence():
    assert REAL.is_file() and (REAL.parent / "WANDS-LICENSE").read_text().startswith("MIT License")
    held, recorded = real_requests("real"), real_requests("real-traffic")
    assert len(recorded) == REAL_TRAFFIC and len(held) == 480 - REAL_TRAFFIC
    assert not {r.query.lower() for r in held} & {r.query.lower() for r in recorded}
    assert all(r.task == "search" and r.gold is None and r.meta["source"] == "WANDS" for r in held + recorded)
    assert [r.id for r in load_data("real")] == [r.id for r in held]
    assert [r.id for r in load_request_set("real", 10)] == [r.id for r in held[:26]]  # n + the warm-up's spare
    with pytest.raises(ValueError, match="real-traffic"):
        real_requests("dev")


def test_no_real_query_is_one_the_bundled_drafters_trained_on():
    """The bundled head and pointer were trained on the generator's training split: a real query there would
    make the held-out measure a training measure."""
    trained = {r.query.lower() for r in generate("train", DEFAULT_SIZES["train"])}
    real = real_requests("real") + real_requests("real-traffic")
    assert not trained & {r.query.lower() for r in real}
