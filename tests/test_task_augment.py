"""Substituted training requests: values no generator or novel pool has, gold rewritten consistently."""

from __future__ import annotations

import re

import pytest

from cartspec.task import generator as g
from cartspec.task.augment import SUBSTITUTE_WORDS, substituted_requests
from cartspec.task.novel import all_novel_words


def _tokens(words: set[str]) -> set[str]:
    return {t for w in words for t in re.findall(r"[a-z0-9]+", w.lower())}


def test_substitute_words_share_no_word_with_the_generator_or_the_novel_set():
    known = set()
    for pools in (g.PRODUCTS, g.BRANDS, g.MATERIALS, g.SIZES):
        for pool in pools.values():
            known |= {w.lower() for w in pool.seen + pool.held}
    known |= {w.lower() for w in g.COLORS.seen + g.COLORS.held}
    # a training word that shares a token with a novel word would leak the novel set into training
    forbidden = _tokens(known) | _tokens(all_novel_words())
    for w in SUBSTITUTE_WORDS.words():
        assert not _tokens({w}) & forbidden, w


def test_substituted_requests_are_training_phrasings_with_consistent_gold():
    a = substituted_requests(60)
    assert [r.model_dump() for r in a] == [r.model_dump() for r in substituted_requests(60)]
    assert [r.query for r in substituted_requests(60, seed=1)] != [r.query for r in a]
    words = SUBSTITUTE_WORDS.words()
    said_all = lambda r: " / ".join([t.content for t in r.history] + [r.query])  # noqa: E731
    plain = {said_all(r) for r in g.generate("train", 1600, seed=0)}
    for r in a:
        assert r.task == "search" and r.meta["unseen"] == "substituted"
        assert not [f for f in r.meta["families"] if f.endswith(":held")]  # training phrasings only
        said = " ".join([r.query] + [t.content for t in r.history if t.role == "user"]).lower()
        assert r.meta["replaced"]
        for old, new in r.meta["replaced"]:
            assert new in words and new in said and old.lower() not in said.split()
        for key in ("keywords", "brands_include", "brands_exclude", "colors", "material"):
            vals = r.gold.get(key)
            for v in (vals if isinstance(vals, list) else [vals] if vals else []):
                assert v in words, (key, v, r.query)
    assert not [r for r in a if said_all(r) in plain]  # a follow-up ("cheaper ones") differs in its history
    with pytest.raises(ValueError, match="n must be"):
        substituted_requests(0)
