"""vLLM's n-gram proposal (prompt lookup), the copy every hybrid rule starts from."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def lookup(context: Sequence[int], k: int, n_min: int, n_max: int, limit: int | None = None) -> list[int]:
    """vLLM's n-gram proposal on ``context``: the longest suffix n-gram (``n_max`` down to ``n_min``)
    that occurred earlier, and up to ``k`` tokens that followed its earliest occurrence.

    ``limit``: only occurrences whose continuation starts before ``limit`` count, and the
    continuation stops there (``limit`` = the prompt length: look up in the prompt only)."""
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
