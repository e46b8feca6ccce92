"""Rule ``text``: ``anchor`` plus text matching (``copying.text_lookup``).

Inside a string value of the reply where neither the n-gram lookup nor the anchor has a draft, the value's
text so far is searched, case-insensitively and at a word start, in the prompt's text, and the prompt's text
after it, re-encoded with the served tokenizer, is drafted, cut where the head closes the value: a reply
splits a copied word differently from the prompt (``"jack`` + ``et`` where the shopper wrote `` jacket``),
so after its first token no token id of the prompt matches."""

from __future__ import annotations

from ..copying import anchor_lookup
from .step import Step, overlay


class Text:
    name = "text"
    needs_tokens = needs_text = True
    needs_pointer = False

    def draft(self, step: Step) -> list[int]:
        return overlay(step.head, anchor_lookup(step.head, step.context, step.prompt_len, step.ngram(), step.info,
                                                text=True, prompt=step.prompt))
