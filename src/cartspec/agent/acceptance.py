"""Acceptance, defined once for the agent, as the study defines it: accepted draft tokens / proposed draft tokens.

rate = accepted / drafted tokens: ``SpecStats.acceptance_rate``, read from
vLLM's per-request ``speculative_decoding`` counts the way the load generator
reads them. A reply that drafted nothing (plain deployment, or a reply too
short to draft) says nothing about the draft: it is no observation (None),
never a rate of 0.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..bench.metrics import stats_from_responses
from ..bench.results import SpecStats

__all__ = ["SpecStats", "pooled", "reply_stats"]


def reply_stats(spec: dict[str, Any] | None) -> SpecStats | None:
    """One reply's draft counts, or None when it drafted no token."""
    stats = stats_from_responses([spec] if spec else [])
    return stats if stats is not None and stats.acceptance_rate is not None else None


def pooled(stats: Iterable[SpecStats]) -> SpecStats:
    """Counts summed over replies: their rate weighs each reply by its drafted tokens."""
    out = SpecStats(source="responses")
    for s in stats:
        out.drafts += s.drafts
        out.draft_tokens += s.draft_tokens
        out.accepted += s.accepted
    return out
