"""Where the copy rules find what a reply copies: the prompt's continuation after a word or a value's text.

``anchor_lookup`` (rule ``anchor``, and the first step of ``text`` and ``pointer``): a value's first token
looked up alone in the prompt, spaced or not. ``text_lookup`` (rules ``text`` and ``pointer``): a value's
text so far found in the prompt's text. Both are cut where the head closes the value (``cut_at_close``).
``number_lookup`` and ``word_rest`` (the rules that read the tokens' texts: ``rules.base``): a number
value's digits so far found among the prompt's numbers, and the rest of that number; a string value's text
so far that ends inside a prompt word, and the rest of that word. Each ends where the number or the word
does, so the head's close follows it (``splice``) and the head's gate does not judge it.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from .prompt import Prompt, prompt_of
from .tokens import CONT_CHARS, MIN_VALUE_CHARS, SPECIAL_TEXT, TokenInfo, fold, value_open, value_start


def text_lookup(context: Sequence[int], prompt_len: int, k: int, info: TokenInfo,
                prompt: Prompt | None = None) -> list[int]:
    """The ``text`` rule's extra step (module doc): inside a reply's string value, the prompt's text after
    the value's text so far (found at a word start, any case), re-encoded, up to ``k`` tokens; [] where
    the context is not inside a value or its text is not in the prompt. ``prompt``: the context's ``Prompt``
    where the caller keeps one (every function here takes it; without it, ``prompt_of`` finds it).

    Cost per call (the runner calls it per request and step where nothing else matched): a walk back of
    at most ``VALUE_TOKENS`` tokens to the newest quote, which ends there outside a value; inside one, a
    search of the prompt's text (linear in the prompt, in C; the text is joined once per prompt) and one
    ``encode`` of about ``CONT_CHARS * k`` characters."""
    found = value_in_prompt(context, prompt_len, info, prompt)
    if found is None:
        return []
    text, value, p, end = found
    # the reply writes the shopper's word in lower case ("nike" for "Nike"): so on
    return prompt_continuation(text[end:], k, info.encode, lower=value == value.lower() and text[p:end] != value)


def value_in_prompt(context: Sequence[int], prompt_len: int, info: TokenInfo,
                    prompt: Prompt | None = None) -> tuple[str, str, int, int] | None:
    """Inside a reply's string value: the prompt's text, the value's text so far and where that is found in
    the prompt's text (start, end), at a word start, any case, the latest occurrence; None where the context
    is not inside a value, the value is too short to look up or it is not in the prompt."""
    texts = info.texts
    q = value_open(context, prompt_len, info)
    if q < 0:
        return None
    value = texts[context[q]].rsplit('"', 1)[1] + "".join([texts[t] for t in context[q + 1:]])
    # From the first character on (``MIN_VALUE_CHARS``): SmolLM2 often starts a value with a token of one
    # letter ("h" + "unting" of the shopper's "Hunting"), and the prompt's latest word with that initial is
    # then what the reply copies. Where the head knows the value instead (an enum, a size), the rules that
    # copy keep it: the pointer's "no copy" vetoes the text, and the gate keeps a head that is sure of its
    # token (the simulator's figures before and after: docs/archive/2026-12-drafting-research.md, "A value's
    # first character").
    # A token that does not decode alone (a byte of a multi-byte character, U+FFFD) matches nothing real.
    if (len(value) < MIN_VALUE_CHARS or not any(c.isalnum() for c in value) or "\ufffd" in value
            or SPECIAL_TEXT in value):
        return None
    pr = prompt_of(context, prompt_len, prompt)
    text, low, needle = pr.text(texts), pr.folded(texts), fold(value)
    # The latest occurrence at a word start, not the earliest (as the n-gram lookup and the anchor's token
    # search take): the reply extracts the request it answers, the prompt's last message, while earlier
    # text is the system prompt ("Extract the shopper's product search ...": a value starting "pro" or
    # "se" would continue from there), earlier turns and earlier replies. A word right after a special
    # token is a chat template's role name ("<|im_start|>user"), written by no one: it does not count.
    p = low.rfind(needle)
    while p > 0 and (low[p - 1].isalnum() or low[p - 1] == SPECIAL_TEXT):
        p = low.rfind(needle, 0, p + len(needle) - 1)
    if p < 0:
        return None
    return text, value, p, p + len(needle)


NUMBER_TAIL = 8  # reply tokens read back for a number value: ``"price_max": 1299.9`` is 9 on SmolLM2
_NUMBER_SO_FAR = re.compile(r'":\s*(\d+(?:\.\d*)?)$')  # a key's number value, its digits so far
_NUMBER_REST = re.compile(r"\d*(?:\.\d+)?")


def number_lookup(context: Sequence[int], prompt_len: int, k: int, info: TokenInfo,
                  prompt: Prompt | None = None) -> list[int]:
    """Inside a number value of the reply (``"price_max": 2`` so far): the rest of the prompt's latest
    number that starts with the digits so far (``50`` of ``US$250``, ``.2`` of ``4.2 stars``), re-encoded,
    up to ``k`` tokens; [] where the context is not inside a number, no prompt number starts so, or that
    number has no digit left (the head then closes the value).

    The head drafts a number's digits from what it saw in training (``"price_max": 1`` + ``00``), while a
    reply's prices and ratings are the shopper's; the first digit is the pointer's or the target's, the rest
    is copied here, over the head's first positions (``rules.base``), and the gate does not judge it
    (simulated on the dev split's greedy replies at γ=3: τ 3.528 judged by the gate, 3.549 not).

    Cost per call: a look at the last token's text, and only inside a number a join of ``NUMBER_TAIL``
    tokens, a regular expression and a search of the prompt's text (joined once per prompt)."""
    texts = info.texts
    L = len(context)
    if L <= prompt_len or not texts[context[-1]][-1:].isdigit() and not texts[context[-1]].endswith("."):
        return []
    m = _NUMBER_SO_FAR.search("".join([texts[t] for t in context[max(prompt_len, L - NUMBER_TAIL):]]))
    if m is None:
        return []
    needle = m.group(1)
    text = prompt_of(context, prompt_len, prompt).text(texts)
    p = text.rfind(needle)
    while p >= 0:
        before = text[p - 1] if p > 0 else ""
        if not (before.isdigit() or before == "." and p > 1 and text[p - 2].isdigit()):
            break  # the number starts here: not the middle of another one
        p = text.rfind(needle, 0, p + len(needle) - 1)
    if p < 0:
        return []
    rest = _NUMBER_REST.match(text, p + len(needle)).group()
    if not rest:
        return []
    return [int(i) for i in info.encode(rest)[:k]]


def word_rest(context: Sequence[int], prompt_len: int, k: int, info: TokenInfo,
              prompt: Prompt | None = None) -> list[int]:
    """Inside a reply's string value whose text so far ends inside one of the prompt's words (``chartre`` of
    the shopper's ``chartreuse``, found as ``text_lookup`` finds it): the rest of that word, re-encoded (in
    lower case where the value is), up to ``k`` tokens; [] where the value's text ends at a word's end or is
    not in the prompt.

    A value stops inside a word of the shopper's rarely, while the head, meeting a word it never saw, often
    closes it there and is sure of it (p >= 0.9 at ``"colors": ["chart`` of "chartreuse"). In the simulator's
    replay of the novel set (100 greedy replies, γ=3), 94 of the 199 steps whose first rejected token was a
    copied value's were such a close inside a word. Where the head goes on as an identifier instead, the
    value is an enum that starts like the shopper's word (``"sort": "price_asc"`` for "pricey"): ``splice``
    keeps the head's draft there."""
    last = info.texts[context[-1]] if len(context) > prompt_len else ""
    if not last[-1:].isalnum():
        return []
    found = value_in_prompt(context, prompt_len, info, prompt)
    if found is None:
        return []
    text, value, _, end = found
    e = end
    while e < len(text) and text[e].isalnum():
        e += 1
    if e == end:
        return []
    rest = text[end:e]
    return [int(i) for i in info.encode(rest.lower() if value == value.lower() else rest)[:k]]


JOINERS = "_-"  # a token that starts so continues an identifier: ``"price`` + ``_asc``


def splice(head: Sequence[int], rest: Sequence[int], info: TokenInfo) -> list[int]:
    """``rest`` over the first positions of ``head``, with the head's close after it: k tokens.

    * Where the head closes the value inside ``rest``'s positions (its token is JSON structure where it
      first differs), its draft from that token on follows ``rest``.
    * Where it drafts another word there (``25`` for the shopper's ``20``, ``car`` for ``inky`` of
      "slinky") and closes that word later in its draft, its draft from that close on follows ``rest``, its
      later tokens filling what is left: ``rest`` ends where the prompt's word or number does, and the
      head, drafting from its own tokens, put its close after its own word, one or more positions off.
    * Where the head goes on as an identifier (a token starting with one of ``JOINERS``: ``"refund`` +
      ``_window`` where the shopper wrote "refunds"), ``head`` unchanged: the value is an enum that starts
      like the shopper's word.

    Otherwise ``rest`` is laid over the head's first positions."""
    head, rest = list(head), list(rest)[:len(head)]
    for j, r in enumerate(rest):
        if head[j] != r:
            if info.structure[head[j]]:
                return (rest + head[j:])[:len(head)]
            if info.texts is not None and info.texts[head[j]][:1] in JOINERS:
                return head
            close = next((q for q in range(j + 1, len(head)) if info.structure[head[q]]), None)
            if close is not None and close != len(rest):
                out = rest + head[close:]
                return (out + head[len(out):])[:len(head)]
            break
    return rest + head[len(rest):]


def prompt_continuation(cont: str, k: int, encode: Any, lower: bool = False) -> list[int]:
    """The prompt's text ``cont`` drafted: up to the prompt turn's end and about ``CONT_CHARS * k``
    characters, in lower case if ``lower``, re-encoded; its first ``k`` tokens ([] where nothing is left).
    Shared by the ``text`` rule and the pointer (``draft.pointer.continuation``)."""
    stop = len(cont)
    for mark in (SPECIAL_TEXT, "\ufffd"):  # the prompt's turn ends / a character that did not decode alone
        i = cont.find(mark, 0, stop)
        if i >= 0:
            stop = i
    if stop > CONT_CHARS * k:  # enough for k tokens, cut before a space: the tokens before it are unchanged
        sp = cont.find(" ", CONT_CHARS * k, stop)
        if sp >= 0:
            stop = sp
    cont = cont[:stop]
    if not cont:
        return []
    return [int(i) for i in encode(cont.lower() if lower else cont)[:k]]


def anchor_lookup(head: Sequence[int], context: Sequence[int], prompt_len: int, look: Sequence[int],
                  info: TokenInfo, text: bool = False, prompt: Prompt | None = None) -> list[int]:
    """The ``anchor`` rule's lookup tokens (module doc): ``look`` (the n-gram lookup's) dropped at a value's
    start where it disagrees with the head, else, where there is none and the context's last token starts a
    value, the prompt's continuation after that word (spaced or not); cut where the head closes the value.
    ``text`` (the ``text`` rule): where there is still none, ``text_lookup``'s, cut the same way."""
    look = list(look)
    if look and look[0] != head[0] and info.opens[context[-1]]:
        look = []  # a value's first token: the lookup would copy an earlier turn's value, the head knows better
    if not look:
        t = context[-1]
        if info.content[t] and value_start(context, prompt_len, info):
            pr = prompt_of(context, prompt_len, prompt)
            firsts = [q for c in {t, int(info.twin[t])} - {-1} if 0 <= (q := pr.first(c)) < len(pr) - 1]
            if firsts:  # the earliest occurrence of the token or its twin, not the prompt's last token
                q = min(firsts)
                look = list(pr.tokens[q + 1:q + 1 + len(head)])
    if not look and text:
        look = text_lookup(context, prompt_len, len(head), info, prompt)
    return cut_at_close(look, head, info)


def cut_at_close(look: Sequence[int], head: Sequence[int], info: TokenInfo) -> list[int]:
    """``look`` up to the first position where it differs from ``head`` and the head's token is JSON
    structure: the head closes the value (or the array) there, while the prompt's sentence goes on."""
    for j in range(min(len(look), len(head))):
        if look[j] != head[j] and info.structure[head[j]]:
            return list(look[:j])
    return list(look)
