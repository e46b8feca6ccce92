"""Requests whose words the model never saw: neither in training nor in the test split.

The test split already draws most values from the generator's held-out pools,
but those pools are fixed, and the same held-out words recur across its 400
requests (and every tuning run looks at them). This set goes one step further:
requests written by the generator in the held-out style (``generate("test",
...)`` with another seed, so held-out phrasings too), in which every product,
brand, colour and material the shopper wrote is replaced by a word from the
pools below, which are in no generator pool (seen or held), nor share a word with one (a test
checks).
The gold answer gets the same replacement, so the request stays correct.
A request is kept only when every such value was found verbatim in what the
shopper wrote (a typo'd or abbreviated value cannot be replaced consistently)
and at least one was replaced; support requests have nothing to replace and are
left out.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from .data import Request, Turn

NOVEL_PRODUCTS: dict[str, tuple[str, ...]] = {
    "shoes": ("moccasins", "huaraches", "galoshes"),
    "clothing": ("kimono", "poncho", "dungarees", "kaftan"),
    "electronics": ("label printer", "walkie talkie", "metronome"),
    "home": ("colander", "salad spinner", "trivet"),
    "beauty": ("pomade", "loofah", "toner"),
    "sports": ("snorkel", "frisbee", "trampoline"),
    "toys": ("kaleidoscope", "xylophone", "slinky"),
    "bags": ("satchel", "rucksack", "pannier"),
    "jewelry": ("tiara", "locket", "amulet"),
    "grocery": ("kombucha", "tahini", "quinoa"),
}
NOVEL_BRANDS: dict[str, tuple[str, ...]] = {
    "shoes": ("karhu", "diadora"), "clothing": ("barbour", "rapha"), "electronics": ("wacom", "roku"),
    "home": ("bialetti", "vitamix"), "beauty": ("weleda", "sisley"), "sports": ("rossignol", "petzl"),
    "toys": ("brio", "tamiya"), "bags": ("filson", "mismo"), "jewelry": ("skagen", "orient"),
    "grocery": ("teekanne", "tiptree"),
}
NOVEL_COLORS = ("chartreuse", "ochre", "vermilion", "periwinkle", "cerulean", "saffron")
NOVEL_MATERIALS: dict[str, tuple[str, ...]] = {
    "shoes": ("hemp",), "clothing": ("alpaca", "mohair", "tencel"), "home": ("rattan", "pewter"),
    "bags": ("hemp", "raffia"), "jewelry": ("pewter",), "sports": ("kevlar",),
}


@dataclass(frozen=True)
class ValuePools:
    """The words a substitution draws from: products, brands and materials per category, colours for all."""

    products: dict[str, tuple[str, ...]]
    brands: dict[str, tuple[str, ...]]
    colors: tuple[str, ...]
    materials: dict[str, tuple[str, ...]]

    def words(self) -> set[str]:
        words = {w for pool in self.products.values() for w in pool}
        words |= {w for pool in self.brands.values() for w in pool}
        words |= set(self.colors)
        words |= {w for pool in self.materials.values() for w in pool}
        return words


NOVEL = ValuePools(NOVEL_PRODUCTS, NOVEL_BRANDS, NOVEL_COLORS, NOVEL_MATERIALS)


def all_novel_words() -> set[str]:
    return NOVEL.words()


def _pattern(value: str) -> re.Pattern:
    return re.compile(r"(?<![A-Za-z0-9])" + re.escape(value) + r"(?![A-Za-z0-9])", re.IGNORECASE)


def substitute(req: Request, rng: random.Random, words: ValuePools = NOVEL,
               tag: str = "novel") -> Request | None:
    """``req`` with every product, brand, colour and material of its gold answer replaced, in the gold and
    in what the shopper wrote, by a word of ``words``; None when a value cannot be replaced consistently
    (module doc). ``meta["unseen"]`` records ``tag``."""
    gold = req.gold
    if req.task != "search" or not isinstance(gold, dict):
        return None
    category = gold.get("category")
    plan: list[tuple[str, str]] = []  # (old value, new value)
    used: set[str] = set()

    def pick(pool: tuple[str, ...]) -> str | None:
        free = [w for w in pool if w not in used]
        if not free:
            return None
        w = rng.choice(free)
        used.add(w)
        return w

    def values(key: str) -> list[str]:
        v = gold.get(key)
        return [] if v is None else (list(v) if isinstance(v, list) else [v])

    pools: list[tuple[str, tuple[str, ...]]] = [
        ("keywords", words.products.get(category, ())), ("brands_include", words.brands.get(category, ())),
        ("brands_exclude", words.brands.get(category, ())), ("colors", words.colors),
        ("material", words.materials.get(category, ()))]
    texts = [req.query] + [t.content for t in req.history if t.role == "user"]
    for key, pool in pools:
        for old in values(key):
            if not isinstance(old, str):
                return None
            if not any(_pattern(old).search(t) for t in texts):
                return None  # typo'd, abbreviated or reworded: cannot replace it consistently
            new = pick(pool)
            if new is None:
                return None
            plan.append((old, new))
    if not plan:
        return None

    def sub_text(text: str) -> str:
        # longest first, so "trail running shoes" is replaced before "running shoes"
        for old, new in sorted(plan, key=lambda p: -len(p[0])):
            text = _pattern(old).sub(new, text)
        return text

    def sub_value(v: Any) -> Any:
        if isinstance(v, list):
            return [sub_value(x) for x in v]
        if isinstance(v, str):
            for old, new in plan:
                if v.lower() == old.lower():
                    return new
        return v

    new_gold = {k: (sub_value(v) if k in {p[0] for p in pools} else v) for k, v in gold.items()}
    history = [Turn(role=t.role, content=sub_text(t.content)) for t in req.history]
    meta = {**(req.meta or {}), "unseen": tag, "replaced": [list(p) for p in plan]}
    return req.model_copy(update={"query": sub_text(req.query), "history": history, "gold": new_gold, "meta": meta})


def substituted(split: str, n: int, seed: int, rng_seed: int, words: ValuePools, tag: str) -> list[Request]:
    """The first ``n`` requests of ``generate(split, 4 n, seed)`` that ``substitute`` rewrites with ``words``
    (ids ``TAG-00000``...); raises ValueError when fewer than ``n`` can be."""
    from .generator import generate

    if n < 1:
        raise ValueError("n must be >= 1")
    rng = random.Random(rng_seed)
    out: list[Request] = []
    batch = 4 * n
    for req in generate(split, batch, seed=seed):
        new = substitute(req, rng, words, tag)
        if new is not None:
            new.id = f"{tag}-{len(out):05d}"
            out.append(new)
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} of {n} {tag} requests from {batch} generated ones")


def novel_requests(n: int, seed: int = 0) -> list[Request]:
    """``n`` search requests in the held-out style whose products, brands, colours and materials are
    words in no generator pool (module doc); the same (n, seed) always gives the same list."""
    # a seed the test split (seed 0) never uses
    return substituted("test", n, seed=1000 + seed, rng_seed=7_000_003 + seed, words=NOVEL, tag="novel")


def novel_traffic(n: int, seed: int, check: list[Request], pool: int | None = None) -> list[Request]:
    """``n`` novel requests drawn from ``novel_requests(pool, seed)`` (default pool ``3 * n``), each query once
    and none whose query is in ``check`` (task and query compared with whitespace and case ignored): traffic of
    the novel kind that never repeats itself or the set its acceptance is measured on."""
    def key(r: Request) -> tuple[str, str]:
        return r.task, " ".join(r.query.lower().split())

    seen, out = {key(r) for r in check}, []
    for r in novel_requests(pool or 3 * n, seed):
        if key(r) not in seen:
            seen.add(key(r))
            out.append(r)
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct novel requests outside the check set; ask for fewer")
    return out[:n]
