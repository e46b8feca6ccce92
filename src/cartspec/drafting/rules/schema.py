"""Rule ``schema``: the head's draft with the reply's JSON schema (``drafting.schema``, ``Track.combine``). The
head's tokens stand while the grammar accepts them; inside a short string value a copy the schema drafter
finds in the prompt replaces them; from a token the grammar refuses, the schema drafter drafts the rest. A reply that is not the schema's JSON (a free-text answer) keeps the head's draft. A
draft shorter than the head's is filled up with the head's tokens (vLLM verifies ``k`` tokens per request
in EAGLE's batch; they are likely rejected and cost what the head's own would)."""

from __future__ import annotations

from .step import Step


class SchemaRule:
    name = "schema"
    needs_tokens = needs_text = needs_pointer = False
    needs_schema = True

    def draft(self, step: Step) -> list[int]:
        out = step.schema.track_for(step.context, step.prompt_len).combine(step.head)
        return out + list(step.head[len(out):])
