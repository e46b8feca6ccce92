"""Rule ``pointer`` (the default): ``text`` plus a trained pointer (``drafting.pointer``: which word of the
prompt a value copies, or none).

(1) At the first draft position that follows a value's opening quote (the context's last token or a
drafted one) and that the lookup does not draft, the pointer's pick, the prompt's text from that word on
re-encoded, replaces the draft, cut where the head closes the value; where it says "no copy" (or is less
sure than its ``min_p``) the draft stays. (2) Where the lookup drafts a value's opening quote and the head
agrees with it up to there but not on the value, the head's draft is taken if the pointer says the value
copies nothing (at least ``veto_p``): an earlier turn's value of the same key. (3) Inside a value the
pointer says copies nothing, the anchor's and the text rule's copies are dropped (the n-gram lookup's stay).
(4) At the first draft position where a number value starts (after ``": ``, not the lookup's) and the head
drafts a digit, the pointer's pick among the prompt's numbers (``number_pick``), the head's close after it.
The copied values the other rules miss are mostly a value's first token, which the head drafts wrong and
no lookup can pick among the prompt's words: the pointer picks it."""

from __future__ import annotations

from typing import Any, Sequence

from ..copying import anchor_lookup, cut_at_close
from ..prompt import Prompt
from ..tokens import SPECIAL_TEXT, TokenInfo, number_open, value_open
from .step import Step, overlay, vetoed


class PointerRule:
    name = "pointer"
    needs_tokens = needs_text = needs_pointer = True

    def draft(self, step: Step) -> list[int]:
        head, context, prompt_len, info, pointer = step.head, step.context, step.prompt_len, step.info, step.pointer
        ngram = step.ngram()
        look = anchor_lookup(head, context, prompt_len, ngram, info, text=True, prompt=step.prompt)
        if look and not ngram and vetoed(context, prompt_len, info, pointer, step.prompt):
            look = []  # the anchor's or the text rule's copy, inside a value the pointer says copies nothing
        n = min(len(look), len(head))
        return pointer_draft(overlay(head, look), head, n, context, prompt_len, info, pointer, step.prompt)


def pointer_draft(draft: Sequence[int], head: Sequence[int], n_look: int, context: Sequence[int], prompt_len: int,
                  info: TokenInfo, pointer: Any, prompt: Prompt | None = None) -> list[int]:
    """The ``pointer`` rule's step (module doc): at the first draft position that follows a value's opening
    quote (in the context or drafted) and is not the lookup's (``n_look``: how many leading positions of
    ``draft`` are), the pointer's pick (``draft.pointer.Pointer.pick``) replaces the draft from there, the
    head's tokens filling what it leaves; where it picks "no copy" the draft is kept."""
    draft = list(draft)
    k = len(draft)
    for i in range(k):
        last = draft[i - 1] if i else context[-1]
        if not info.opens[last]:
            if (i >= n_look and info.digit[draft[i]] and getattr(pointer, "numbers", False)
                    and (info.colon[last] or not info.texts[last].strip())):
                ctx = list(context) + draft[:i]
                if number_open(ctx, prompt_len, info):
                    return draft[:i] + number_pick(ctx, prompt_len, head[i:], info, pointer, prompt)
            continue
        ctx = list(context) + draft[:i]
        if value_open(ctx, prompt_len, info) != len(ctx) - 1:
            continue
        if i < n_look:  # the lookup drafts this value: the head's instead where the two agreed up to here,
            # differ on the value and the pointer says it copies nothing (an earlier turn's value for the key)
            if (draft[:i] == list(head[:i]) and draft[i] != head[i]
                    and pointer.no_copy(ctx, prompt_len, info.texts, info.encode, SPECIAL_TEXT,
                                        prompt=prompt) >= pointer.cfg.veto_p):
                return list(head)
            return draft
        pick = pointer.pick(ctx, prompt_len, k - i, info.texts, info.encode, SPECIAL_TEXT, prompt=prompt)
        pick = cut_at_close(pick, head[i:], info)
        return draft[:i] + pick + list(head[i + len(pick):])
    return draft


def number_pick(context: Sequence[int], prompt_len: int, head: Sequence[int], info: TokenInfo,
                pointer: Any, prompt: Prompt | None = None) -> list[int]:
    """At a number value's start where the head drafts a digit (its ``len(head)`` tokens from there): the
    pointer's pick among the prompt's numbers, then the head's tokens from where its own number ends (its
    close: ``"price_max": `` + ``1``, ``0``, ``,`` -> ``5``, ``0``, ``,`` where the shopper wrote 50); the
    head's draft where the pointer picks "no copy"."""
    head = list(head)
    pick = pointer.pick(context, prompt_len, len(head), info.texts, info.encode, SPECIAL_TEXT, numbers=True,
                        prompt=prompt)
    if not pick:
        return head
    e = 0
    while e < len(head) and (info.digit[head[e]] or info.texts[head[e]] == "."):
        e += 1
    out = pick + head[e:]
    return (out + head[len(out):])[:len(head)]
