"""The hot cache: normalised keys, bound, TTL, in-flight sharing."""

from __future__ import annotations

import asyncio

import pytest

from cartspec.agent.cache import HotCache, normalise, request_key
from cartspec.agent.config import CacheConfig


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_normalise_ignores_case_spacing_and_unicode_form_but_keeps_ids():
    assert normalise("  Red   NIKE\tshoes ") == "red nike shoes"
    assert normalise("ｓｈｏｅｓ") == "shoes"  # full-width (NFKC)
    assert normalise("Where is order AB12CD?") == "where is order AB12CD?"
    assert request_key("support", "order AB12") != request_key("support", "order ab12")
    assert request_key("search", "Boots") == request_key("search", "boots ")
    assert request_key("search", "boots") != request_key("support", "boots")
    assert request_key("search", "cheaper", [("user", "boots")]) != request_key("search", "cheaper")


def test_ttl_expires_entries():
    clock = Clock()
    cache = HotCache(CacheConfig(ttl_s=10), clock=clock)
    cache.put("k", {"v": 1})
    clock.t = 9.9
    assert cache.get("k") == {"v": 1}
    clock.t = 10.0
    assert cache.get("k") is None and cache.expirations == 1 and len(cache) == 0


def test_bounded_lru_evicts_least_recently_used():
    cache = HotCache(CacheConfig(max_entries=2))
    cache.put("a", 1)
    cache.put("b", 2)
    cache.get("a")  # a is now the most recent
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3
    assert len(cache) == 2 and cache.evictions == 1


def test_cacheable_respects_switch_and_history_length():
    assert HotCache(CacheConfig(max_history_turns=2)).cacheable(2)
    assert not HotCache(CacheConfig(max_history_turns=2)).cacheable(3)
    assert not HotCache(CacheConfig(enabled=False)).cacheable(0)


def test_identical_requests_in_flight_share_one_call():
    cache = HotCache(CacheConfig())
    calls = 0

    async def compute():
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return {"v": calls}

    async def main():
        return await asyncio.gather(*(cache.get_or_compute("k", compute) for _ in range(5)))

    results = asyncio.run(main())
    assert calls == 1
    assert [r[1] for r in results] == ["miss"] + ["coalesced"] * 4
    assert all(r[0] == {"v": 1} for r in results)


def test_failures_are_shared_but_not_cached():
    cache = HotCache(CacheConfig())

    async def boom():
        await asyncio.sleep(0.01)
        raise RuntimeError("upstream down")

    async def main():
        return await asyncio.gather(*(cache.get_or_compute("k", boom) for _ in range(3)), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) for r in results)
    assert cache.get("k") is None and len(cache) == 0


def test_bypass_recomputes_and_refreshes():
    cache = HotCache(CacheConfig())
    cache.put("k", "old")

    async def fresh():
        return "new"

    value, outcome = asyncio.run(cache.get_or_compute("k", fresh, read=False))
    assert (value, outcome) == ("new", "bypass") and cache.get("k") == "new"


@pytest.mark.parametrize("bad", [{"max_entries": 0}, {"ttl_s": 0}])
def test_config_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        CacheConfig(**bad)
