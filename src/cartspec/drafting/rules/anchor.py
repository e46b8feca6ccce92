"""Rule ``anchor``: ``lookup`` with three changes that read the tokens' text (``copying.anchor_lookup``).

(1) Where the context's last token is a value's first token and the n-gram lookup has no match, that token,
or its twin with the leading space toggled (a reply writes ``"cal`` where the shopper wrote `` cal``), is
looked up alone in the prompt and the prompt's continuation drafted; (2) a lookup token that differs from
the head's where the head's token is JSON structure ends the lookup there: the prompt's sentence goes on
where the reply closes the value; (3) at a value's first position a lookup that disagrees with the head is
dropped: there it copies an earlier turn's value for the same key, and the head knows the enum."""

from __future__ import annotations

from ..copying import anchor_lookup
from .step import Step, overlay


class Anchor:
    name = "anchor"
    needs_tokens = True
    needs_text = needs_pointer = False

    def draft(self, step: Step) -> list[int]:
        return overlay(step.head, anchor_lookup(step.head, step.context, step.prompt_len, step.ngram(), step.info,
                                                 prompt=step.prompt))
