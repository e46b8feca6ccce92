"""Rule ``agree``: as ``lookup``, except that where the lookup's first token is the head's own first token
the head's draft is kept whole (its tail is conditioned on its own tokens, so it is the consistent one)."""

from __future__ import annotations

from .step import Step, overlay


class Agree:
    name = "agree"
    needs_tokens = needs_text = needs_pointer = False

    def draft(self, step: Step) -> list[int]:
        look = step.ngram()
        if look and look[0] == step.head[0]:
            return list(step.head)
        return overlay(step.head, look)
