"""The head's gate: the head's draft stands where it is sure of its own token and a copy differs."""

from __future__ import annotations

from typing import Any, Sequence


def gate(draft: Sequence[int], head: Sequence[int], conf: Any, head_p: float) -> list[int]:
    """``draft`` with the head's tokens from the first position where it differs from the head's ``head``,
    if the head's probability of its own token there (``conf[j]``: a sequence over the positions, or a
    mapping from the positions where it is known) is at least ``head_p`` (> 0); else ``draft``.

    Only the first difference is judged: up to it the draft is the head's own, so the head's probability
    there is the one it drafted with (in vLLM and in the simulator alike); behind a replaced token the
    head's later tokens still follow its own."""
    draft = list(draft)
    if conf is None or head_p <= 0:
        return draft
    for j in range(min(len(draft), len(head))):
        if draft[j] != head[j]:
            try:
                p = float(conf[j])
            except (IndexError, KeyError):  # not known there: no gate
                return draft
            return draft[:j] + list(head[j:]) if p >= head_p else draft
    return draft
