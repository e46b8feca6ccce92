"""Acceptance for the agent, as the study defines it (``cartspec.results.AcceptanceStats``).

rate = accepted / drafted tokens and τ = 1 + accepted / verification steps, read
from vLLM's per-request ``speculative_decoding`` counts the way the load
generator reads them. A reply that drafted nothing (plain deployment, or a reply
too short to draft) says nothing about the draft: it is no observation (None),
never a rate of 0.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..results import AcceptanceStats

__all__ = ["AcceptanceStats", "pooled", "reply_stats"]


def reply_stats(request_spec_metrics: dict[str, Any] | None) -> AcceptanceStats | None:
    """One reply's draft counts, or None when it drafted no token."""
    stats = AcceptanceStats.from_vllm(request_spec_metrics)
    return stats if stats.rate is not None else None


def pooled(stats: Iterable[AcceptanceStats]) -> AcceptanceStats:
    """Counts summed over replies: their rate weighs each reply by its drafted tokens."""
    return AcceptanceStats.pooled(stats)
