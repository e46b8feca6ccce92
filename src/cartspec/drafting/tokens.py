"""What the copy rules read of each token id's text, and the reply's string values they copy into."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

SPECIAL_TEXT = "\x00"  # a special token in the prompt's text (``TokenInfo.texts``): no match crosses it


@dataclass(frozen=True, eq=False)
class TokenInfo:
    """What the ``anchor`` rule reads of each token id's text (arrays over the vocabulary).

    ``content``: a token with a letter or digit (not a special token); ``structure``: JSON punctuation
    only (no letter or digit, one of ``"{}[],:``); ``opens``: ends in ``"`` or ``["`` (opens a key or a
    string value); ``colon``: ends in ``:``; ``bracket``: ``[`` count minus ``]`` count; ``twin``: the
    same text with the leading space toggled (``"cal"`` <-> ``" cal"``) when that is one token, else -1:
    a reply's value starts without the space its word has in the shopper's sentence; ``digit``: starts with
    a digit (a number value's first token: SmolLM2 writes each digit as a token of its own).

    For the ``text`` rule only: ``texts``, each token's text with a special token's as ``SPECIAL_TEXT``
    (a continuation stops there and a special token's text is never matched); ``encode(text)``: the served
    tokenizer's ids for a text (no special tokens). ``None`` where the ``TokenInfo`` was built without them."""

    content: np.ndarray
    structure: np.ndarray
    opens: np.ndarray
    colon: np.ndarray
    bracket: np.ndarray
    twin: np.ndarray
    digit: np.ndarray
    texts: tuple[str, ...] | None = None
    encode: Any = None

    @classmethod
    def from_texts(cls, texts: Sequence[str], special: Sequence[int] = (),
                   encode: Any = None) -> "TokenInfo":
        """``texts[i]``: token ``i`` decoded alone; ``encode(text)``: its ids (for ``twin``; without it,
        a twin is a token whose text is exactly the toggled text; the ``text`` rule needs it)."""
        V = len(texts)
        sp = np.zeros(V, dtype=bool)
        sp[[i for i in special if 0 <= i < V]] = True
        alnum = np.array([sum(c.isalnum() for c in t) for t in texts])
        content = (alnum >= 1) & ~sp
        structure = np.array([a == 0 and any(c in t for c in '"{}[],:') for t, a in zip(texts, alnum)]) & ~sp
        opens = np.array([t.rstrip().endswith(('"', '["')) for t in texts]) & ~sp
        colon = np.array([t.rstrip().endswith(":") for t in texts]) & ~sp
        bracket = np.array([t.count("[") - t.count("]") for t in texts]) * ~sp
        digit = np.array([t[:1].isdigit() for t in texts], dtype=bool) & ~sp
        twin = np.full(V, -1, dtype=np.int64)
        index = {t: i for i, t in enumerate(texts) if not sp[i]} if encode is None else None
        for i, t in enumerate(texts):
            if sp[i] or not t.strip():
                continue
            other = t[1:] if t.startswith(" ") else " " + t
            if encode is None:
                j = index.get(other, -1)
            else:
                ids = encode(other)
                j = ids[0] if len(ids) == 1 else -1
            if 0 <= j < V and not sp[j]:
                twin[i] = j
        kept = tuple(SPECIAL_TEXT if sp[i] else t for i, t in enumerate(texts))
        return cls(content, structure, opens, colon, bracket.astype(np.int64), twin, digit, kept, encode)

    @classmethod
    def from_tokenizer(cls, tok) -> "TokenInfo":
        V = len(tok)
        texts = [tok.decode([i]) for i in range(V)]
        return cls.from_texts(texts, tok.all_special_ids, encoder(tok))


ENCODED = 8192  # texts whose token ids ``encoder`` keeps (keys, punctuation and values recur across requests)


def encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """``tokenizer.encode(text, add_special_tokens=False)``, from the fast tokenizer's Rust backend where it has
    one, the latest ``ENCODED`` texts kept. The backend's ``encode`` of one text gives the same ids (tested) at
    about half the cost (14 against 27 µs a call, measured on the bundled tokenizer), without transformers'
    per-call bookkeeping. The copy rules re-encode a copy at every value they draft, the schema drafter its
    keys and values."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        def encode(text: str) -> tuple[int, ...]:
            return tuple(backend.encode(text, add_special_tokens=False).ids)
    else:
        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))
    kept = functools.lru_cache(maxsize=ENCODED)(encode)
    return lambda text: list(kept(text))


def value_start(context: Sequence[int], prompt_len: int, info: TokenInfo) -> bool:
    """The context's last token is the first token of a string value (or array item) of the reply:
    the token before it opens a string after ``:`` or ``[`` (or inside an array), not a key."""
    if len(context) - prompt_len < 2 or len(context) < 3:
        return False
    q = context[-2]
    if not info.opens[q]:
        return False
    return bool(info.bracket[q] > 0 or info.colon[context[-3]] or info.bracket[context[prompt_len:]].sum() > 0)


# the ``text`` rule's limits (module doc, ``text_lookup``)
VALUE_TOKENS = 16  # tokens since the opening quote searched back for it: a longer value is free text, not a copy
MIN_VALUE_CHARS = 1  # a value's text so far shorter than this is not looked up
CONT_CHARS = 16  # the prompt's text re-encoded: this many characters per draft token, then on to the next space


def value_open(context: Sequence[int], prompt_len: int, info: TokenInfo, max_tokens: int = VALUE_TOKENS) -> int:
    """The position of the opening quote of the reply's string value the context ends inside (not closed
    yet; a value as ``value_start`` defines one: the quote follows ``:`` or ``[`` or is inside an array),
    or -1: outside a value (in a key, between values, in the prompt) or more than ``max_tokens`` into it.
    The context's last token may be the quote itself (the value is empty so far). Needs ``info.texts``."""
    texts = info.texts
    L = len(context)
    for q in range(L - 1, max(prompt_len, L - 1 - max_tokens, 1) - 1, -1):
        t = context[q]
        if '"' not in texts[t]:
            continue
        if info.opens[t] and (info.bracket[t] > 0 or info.colon[context[q - 1]]
                              or info.bracket[context[prompt_len:q + 1]].sum() > 0):
            return q
        return -1  # the newest quote closes a string or opens a key
    return -1


def number_open(context: Sequence[int], prompt_len: int, info: TokenInfo) -> bool:
    """The context ends where a key's value starts and nothing of it is written yet (``"price_max":`` or
    ``"price_max": ``, in the reply): where a number value's first digit comes, if the value is a number
    (``json.dumps`` writes ``": "`` and then the value; a string or an array would open with ``"`` or ``[``)."""
    texts = info.texts
    L = len(context)
    if L <= prompt_len or texts is None:
        return False
    last = context[-1]
    if not texts[last].strip() and len(texts[last]) <= 2 and L - 1 > prompt_len:
        last = context[-2]
    # a key's colon, not free text's ("Order number: 1234" in a support answer)
    return bool(info.colon[last]) and texts[last].rstrip().endswith('":')


def fold(s: str) -> str:
    """``s`` in lower case, character for character (offsets in it are offsets in ``s``)."""
    low = s.lower()
    if len(low) == len(s):  # lower() never shortens a character: equal lengths, equal offsets
        return low
    return "".join(c.lower() if len(c.lower()) == 1 else c for c in s)
