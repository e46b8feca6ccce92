"""Rule ``head``: the head's draft alone. The hybrid then drafts as EAGLE-3 does."""

from __future__ import annotations

from .step import Step


class Head:
    name = "head"
    needs_tokens = needs_text = needs_pointer = False

    def draft(self, step: Step) -> list[int]:
        return list(step.head)
