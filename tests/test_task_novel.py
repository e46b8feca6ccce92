"""The `novel` request set: words in no generator pool, gold rewritten consistently."""

from __future__ import annotations

import re

import pytest

from cartspec.task import generator as g
from cartspec.task.novel import all_novel_words, novel_requests


def _every_generator_value() -> set[str]:
    words: set[str] = set()
    for pools in (g.PRODUCTS, g.BRANDS, g.MATERIALS, g.SIZES):
        for pool in pools.values():
            words |= {w.lower() for w in pool.seen + pool.held}
    words |= {w.lower() for w in g.COLORS.seen + g.COLORS.held}
    return words


def test_novel_words_are_in_no_seen_or_held_pool():
    known = _every_generator_value()
    known_tokens = {t for w in known for t in re.findall(r"[a-z0-9]+", w)}
    for w in all_novel_words():
        assert w not in known, w
        # nor any of its words: "trekking poles" must not reuse "poles" from a training product
        assert not set(re.findall(r"[a-z0-9]+", w)) & known_tokens, w


def test_novel_requests_are_deterministic_and_consistent():
    a, b = novel_requests(40), novel_requests(40)
    assert [r.model_dump() for r in a] == [r.model_dump() for r in b]
    novel = all_novel_words()
    known = _every_generator_value()
    for r in a:
        assert r.task == "search" and r.meta["unseen"] == "novel"
        said = " ".join([r.query] + [t.content for t in r.history if t.role == "user"]).lower()
        for old, new in r.meta["replaced"]:
            assert new in novel and new in said
        for key in ("keywords", "brands_include", "brands_exclude", "colors", "material"):
            vals = r.gold.get(key)
            for v in (vals if isinstance(vals, list) else [vals] if vals else []):
                assert v in novel and v not in known, (key, v, r.query)


def test_novel_requests_rejects_a_bad_size():
    with pytest.raises(ValueError, match="n must be"):
        novel_requests(0)


def test_novel_traffic_never_repeats_itself_or_the_check_set():
    from cartspec.task.novel import novel_traffic

    check = novel_requests(40, 0)
    traffic = novel_traffic(60, 1, check=check)
    key = lambda r: (r.task, " ".join(r.query.lower().split()))  # noqa: E731
    assert len(traffic) == 60 and len({key(r) for r in traffic}) == 60
    assert not {key(r) for r in traffic} & {key(r) for r in check}
    assert [r.query for r in novel_traffic(60, 1, check=check)] == [r.query for r in traffic]
    with pytest.raises(ValueError, match="distinct novel requests"):
        novel_traffic(50, 1, check=check, pool=10)
