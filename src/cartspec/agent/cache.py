"""Hot cache: frequent short exchanges ("where is my order", "red nike running
shoes") skip the model. Bounded (LRU), with a TTL, keyed by the normalised
request; identical requests already in flight share one model call.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal

from .config import CacheConfig

CacheOutcome = Literal["hit", "miss", "coalesced", "bypass", "off"]


def normalise(text: str) -> str:
    """Same request, same key: Unicode forms, spacing and case don't matter.

    Tokens with a digit keep their case: they are order ids, sizes and prices,
    and "AB12" must not be served the reply written for "ab12".
    """
    text = unicodedata.normalize("NFKC", text)
    return " ".join(t if any(c.isdigit() for c in t) else t.casefold() for t in text.split())


def request_key(task: str, query: str, history: list[tuple[str, str]] = ()) -> str:
    payload = [task, normalise(query), [[role, normalise(content)] for role, content in history]]
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


class CoalescedCancelled(RuntimeError):
    pass


@dataclass
class _Entry:
    value: Any
    expires: float


class HotCache:
    def __init__(self, config: CacheConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._items: OrderedDict[str, _Entry] = OrderedDict()
        self._inflight: dict[str, asyncio.Future] = {}
        self.evictions = 0
        self.expirations = 0

    def __len__(self) -> int:
        return len(self._items)

    def cacheable(self, history_turns: int) -> bool:
        return self.config.enabled and history_turns <= self.config.max_history_turns

    def get(self, key: str) -> Any | None:
        entry = self._items.get(key)
        if entry is None:
            return None
        if entry.expires <= self._clock():
            del self._items[key]
            self.expirations += 1
            return None
        self._items.move_to_end(key)
        return entry.value

    def put(self, key: str, value: Any) -> None:
        self._items[key] = _Entry(value, self._clock() + self.config.ttl_s)
        self._items.move_to_end(key)
        while len(self._items) > self.config.max_entries:
            self._items.popitem(last=False)
            self.evictions += 1

    def clear(self) -> None:
        self._items.clear()

    async def get_or_compute(self, key: str, compute: Callable[[], Awaitable[Any]],
                             read: bool = True) -> tuple[Any, CacheOutcome]:
        """The cached value, or the result of ``compute`` (stored on success).

        A second identical request arriving while the first is at the model
        waits for that answer instead of sending its own. An exception is not
        cached; every waiter gets it.
        """
        if read:
            value = self.get(key)
            if value is not None:
                return value, "hit"
            pending = self._inflight.get(key)
            if pending is not None:
                return await asyncio.shield(pending), "coalesced"
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            value = await compute()
        except BaseException as exc:
            if not future.done():
                if isinstance(exc, asyncio.CancelledError):  # the leader's cancel is not the waiters'
                    exc = CoalescedCancelled("the identical request this one waited for was cancelled")
                future.set_exception(exc)
                future.exception()  # marked retrieved: no "never retrieved" warning without waiters
            raise
        else:
            self.put(key, value)
            future.set_result(value)
            return value, ("miss" if read else "bypass")
        finally:
            if self._inflight.get(key) is future:
                del self._inflight[key]
