"""Rule ``pointer-schema``: the ``pointer`` rule's draft, then checked against the reply's JSON schema as rule
``schema`` checks the head's (``drafting.schema``, ``Track.combine``).

The pointer picks which of the shopper's words a value starts with (the token the head and every lookup
miss most); the schema drafter then keeps the draft while the grammar accepts it, completes a short string
value from the prompt's words where the draft leaves them, and drafts from the first token the grammar
refuses (an object's end, the next key in schema order). The head's gate judges the result as it judges
rule ``pointer``'s. Where no schema applies (a reply that is not the schema's JSON) the pointer's draft
stands."""

from __future__ import annotations

from .step import Step
from .pointer import PointerRule


class PointerSchema:
    name = "pointer-schema"
    needs_tokens = needs_text = needs_pointer = True
    needs_schema = True

    def draft(self, step: Step) -> list[int]:
        base = PointerRule().draft(step)
        out = step.schema.track_for(step.context, step.prompt_len).combine(base)
        return out + base[len(out):]
