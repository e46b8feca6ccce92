"""Rule ``lookup``: a prompt lookup match overrides the head at the positions it covers; the head's tokens
fill the positions after it. Without a match the head's draft is kept."""

from __future__ import annotations

from .step import Step, overlay


class Lookup:
    name = "lookup"
    needs_tokens = needs_text = needs_pointer = False

    def draft(self, step: Step) -> list[int]:
        return overlay(step.head, step.ngram())
