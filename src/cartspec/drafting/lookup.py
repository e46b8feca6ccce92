"""vLLM's n-gram proposal (prompt lookup), the copy every hybrid rule starts from.

In the prompt (``limit`` = the prompt's length, the hybrid's scope ``prompt``) the prompt's n-grams are
indexed once per prompt (``prompt_index.PromptIndex``, kept by the request's ``prompt.Prompt``), so a verify step
costs a dictionary lookup per n-gram size instead of a scan of the whole context: the runner asks once
per request and step. ``lookup_scan`` is the scan, kept as the reference the index is tested against and
for the scope ``context`` (prompt + reply, which grows every step).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .prompt import Prompt, prompt_of
from .prompt_index import PromptIndex  # noqa: F401 (re-exported)


def _ints(tokens: Sequence[int]) -> list[int]:
    return tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)


def lookup(context: Sequence[int], k: int, n_min: int, n_max: int, limit: int | None = None,
           prompt: Prompt | None = None) -> list[int]:
    """vLLM's n-gram proposal on ``context``: the longest suffix n-gram (``n_max`` down to ``n_min``)
    that occurred earlier, and up to ``k`` tokens that followed its earliest occurrence.

    ``limit``: only occurrences whose continuation starts before ``limit`` count, and the
    continuation stops there (``limit`` = the prompt length: look up in the prompt only; ``prompt``: the
    context's ``Prompt`` where the caller keeps one, whose index is then read without finding it)."""
    L = len(context)
    if limit is None or L - 1 < limit:
        return lookup_scan(context, k, n_min, n_max, limit)
    pr = prompt_of(context, limit, prompt)
    idx = pr.index(n_min, n_max)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        if limit - n < 0:
            continue
        s = idx.first[n].get(tuple(_ints(context[L - n:])))
        if s is not None:
            st = s + n
            return list(pr.tokens[st:min(st + k, limit)])
    return []


def lookup_scan(context: Sequence[int], k: int, n_min: int, n_max: int, limit: int | None = None) -> list[int]:
    """``lookup`` by scanning the context (module doc)."""
    ctx = np.asarray(context, dtype=np.int64)
    L = len(ctx)
    end = L - 1 if limit is None else min(L - 1, limit)  # an occurrence must end before position `end`
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        if end - n < 0:
            continue
        suffix = ctx[L - n:]
        # windows starting at 0 .. end-n (the occurrence ends by position end-1)
        win = np.lib.stride_tricks.sliding_window_view(ctx[:end], n)
        hits = np.flatnonzero((win == suffix).all(axis=1))
        if hits.size:
            st = int(hits[0]) + n
            stop = L if limit is None else min(L, limit)
            return ctx[st:min(st + k, stop)].tolist()
    return []
