"""Hybrid drafts: EAGLE-3 everywhere, prompt lookup where the reply copies the request.

A search-parameters reply is mostly JSON structure and keys, which an EAGLE-3
head trained on the target's replies predicts well, and values copied from what
the shopper wrote, which it predicts badly (it learnt the values it saw, not to
copy; a word outside its draft vocabulary can never be drafted). Prompt lookup
(vLLM's ``ngram`` method) is the opposite. The hybrid runs the head and, per
request and verify step, a prompt lookup; ``combine`` decides per draft position
which of the two proposals is verified. Verification is untouched (the target
checks whatever is drafted), so replies are exactly the target's: at T=0 they
are identical to plain decoding's.

The lookup (``lookup``) is vLLM's n-gram proposer: the longest suffix n-gram of
the context, ``n_max`` down to ``n_min`` tokens, that occurred earlier; the
tokens that followed its earliest occurrence are proposed. With ``scope =
"prompt"`` only occurrences inside the prompt count (and the continuation stops
at the prompt's end): what the shopper and earlier turns wrote, not the reply's
own JSON, which the head drafts better. ``scope = "context"`` searches prompt +
output, as vLLM's n-gram does.

The rule (``combine``), chosen offline with ``draft.simulate.simulate_hybrid``
on the target's greedy replies (see ``RULES``):

* ``lookup``: a lookup match overrides the head at the positions it covers; the
  head's tokens fill the positions after it. Without a match the head's draft is
  kept unchanged.
* ``agree``: as ``lookup``, except that where the lookup's first token is the
  head's own first token the head's draft is kept whole (its tail is conditioned
  on its own tokens, so it is the consistent one).
* ``head``: the head alone (for checks: the hybrid then equals EAGLE-3).
* ``anchor``: ``lookup`` with three changes that read the tokens' text (``TokenInfo``, built from the
  tokenizer: the runner loads the served model's): (1) where the context's last token is a value's first
  token (after a quote that follows ``:`` or ``[`` or is inside an array) and the n-gram lookup has no
  match, that token, or its twin with the leading space toggled (a reply writes ``"cal`` where the
  shopper wrote `` cal``), is looked up alone in the prompt and the prompt's continuation drafted;
  (2) a lookup token that differs from the head's where the head's token is JSON structure (``",``,
  ``"],``, ``}``) ends the lookup there: the prompt's sentence goes on where the reply closes the value;
  (3) at a value's first position (the context ends in an opening quote) a lookup that disagrees with the
  head is dropped: there it copies an earlier turn's value for the same key (``"intent": "search"`` in a
  refine turn), and the head knows the enum.
* ``text``: ``anchor`` plus one step that matches text instead of token ids. Inside a string value of the
  reply (its opening quote as ``value_start`` defines a value, not yet closed) where neither the n-gram
  lookup nor the anchor's token/twin search has a draft, the value's text so far (its tokens decoded,
  from after the quote) is searched, case-insensitively and at a word start, in the prompt's text (its
  tokens decoded one by one), and the prompt's text after it, re-encoded with the served tokenizer, is
  drafted, then cut where the head closes the value as in ``anchor``: a reply splits a copied word
  differently from the prompt (``"jack`` + ``et`` where the shopper wrote `` jacket``), so after the
  reply's first token no token id of the prompt matches, and the head drafts the rest of a word it
  never saw. A reply value in lower case where the prompt's word is not (``nike`` for `` Nike``) gets
  the continuation in lower case.
* ``pointer``: ``text`` plus a trained pointer (``draft.pointer``: which word of the prompt a value copies,
  or none). (1) At the first draft position that follows a value's opening quote (the context's last token
  or a drafted one) and that the lookup does not draft, the pointer's pick, the prompt's text from that
  word on re-encoded, replaces the draft, cut where the head closes the value; where it says "no copy" (or
  is less sure than its ``min_p``) the draft stays. (2) Where the lookup drafts a value's opening quote and
  the head agrees with it up to there but not on the value, the head's draft is taken if the pointer says
  the value copies nothing (at least ``veto_p``): an earlier turn's value of the same key. (3) Inside a value
  the pointer says copies nothing, the anchor's and the text rule's copies are dropped (the n-gram lookup's
  stay). The copied values the other rules miss are mostly a value's first token, which the head drafts
  wrong and no lookup can pick among the prompt's words: the pointer picks it.

The head's gate (``gate``, ``HybridConfig.head_p``; any rule, by default 0.9 for ``pointer`` and off for the
others): at the first position where the combined draft differs from the head's, the head's draft stands
from there on if the head's probability of its own token there is at least ``head_p``. A value can start
with a word of the prompt and go on as an enum the head knows (``"topic": "refund_window"`` where the
shopper wrote "refund?", ``"delivery": "free_shipping"`` for "free shipping", ``"audience": "kids"`` where
the pointer picks "children"); there the copy displaced a right head. How ``head_p`` was chosen, with the commands behind
it: docs/drafting.md, "How the hybrid's defaults were chosen".

``HybridConfig``'s defaults, rule ``lookup`` in the prompt with 3–4-token matches, are the combination
that came out best in the simulator's first search; ``serve`` and the examples use rule ``pointer``.
Which rule drafts what, measured in vLLM and in the simulator with the commands that rerun it:
docs/drafting.md ("Hybrid drafts"). How the rules were found (the lookup's scope and n-gram sizes, then
``anchor``, ``text`` and ``pointer``, each answering where the one before lost a token class): the
simulator search in docs/experiments.md ("The hybrid's rule search in the simulator" and the hybrid
sections before it). The hybrid has been measured in vLLM since rule ``anchor``; its throughput beside
the head alone is in the README's study table and docs/drafting.md.

Where it plugs into vLLM 0.32 (as installed)
--------------------------------------------
vLLM's ``custom_class`` speculative method cannot do this: the runner calls a
custom proposer's ``propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, slot_mappings=...)`` with token ids only
(``GPUModelRunner.propose_draft_token_ids``), never the target's hidden states,
and an EAGLE-3 head drafts from the target's aux hidden states. So the server
runs method ``eagle3`` and cartspec wraps ``GPUModelRunner.propose_draft_token_ids``
(``patch_runner``), through the import hook that already patches vLLM in every
server cartspec starts (``vllm_fixes.PATCHES``): the wrapper calls the original
(the head's ``[num_reqs, k]`` draft tensor), runs the lookup per request and
returns the combined tensor. The settings travel in the environment variable
``CARTSPEC_HYBRID`` (JSON), set by ``VllmServer`` for a ``method: hybrid``
deployment: vLLM's ``SpeculativeConfig`` is a pydantic dataclass that rejects
keys it does not know. Without the variable the runner is untouched.

The gate needs the head's probability of the token it drafted, which vLLM's drafter never computes (it
takes an argmax): ``record_hidden`` wraps the drafter's ``_greedy_sample`` (vLLM 0.32's one place where
each greedy draft token is chosen, the first position and each after it) on the instance to keep the hidden
states it chose from, and ``hybrid_drafts``, once it knows where each request's combined draft first
differs from the head's, asks ``head_probs`` for just those rows (one ``compute_logits`` per step). Where
the drafter samples its drafts nothing is recorded and no gate applies.

In eagle's padded-batch mode (vLLM's default) the drafter runs *before* the
runner's bookkeeping: ``input_batch.token_ids_cpu`` / ``num_tokens_no_spec`` do
not yet hold this step's accepted tokens, which are in ``sampled_token_ids``
([num_reqs, k+1], -1 after the first rejection). The wrapper appends them
(``context_for``). With ``disable_padded_drafter_batch`` the drafter runs after
bookkeeping and gets lists; the token rows are then already complete.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

ENV = "CARTSPEC_HYBRID"
RULES = ("lookup", "agree", "head", "anchor", "text", "pointer")
NEEDS_TOKENS = ("anchor", "text", "pointer")  # rules that read the tokens' text (``TokenInfo``)
SCOPES = ("prompt", "context")
# ``HybridConfig.head_p`` where it is not given: chosen for rule ``pointer`` in the simulator on the dev split's
# greedy replies (module doc); the other rules keep the drafts they were measured with
HEAD_P = {"pointer": 0.9}


@dataclass(frozen=True)
class HybridConfig:
    """The hybrid's settings; the defaults are the rule chosen offline (module doc)."""

    n_min: int = 3
    n_max: int = 4
    rule: str = "lookup"
    scope: str = "prompt"
    pointer: str = ""  # rule ``pointer``: the trained pointer's directory ("" = the bundled one)
    # the head's gate (``gate``): where a copy first differs from the head's draft and the head's probability
    # of its own token there is at least this, the head's draft stands from there; 0 = off; None = the
    # rule's default (``HEAD_P``)
    head_p: float | None = None

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"hybrid rule must be one of {RULES}, got {self.rule!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"hybrid scope must be one of {SCOPES}, got {self.scope!r}")
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={self.n_min}, n_max={self.n_max}")
        if self.head_p is None:
            object.__setattr__(self, "head_p", HEAD_P.get(self.rule, 0.0))
        if not 0.0 <= self.head_p <= 1.0:
            raise ValueError(f"hybrid head_p must be in [0, 1] (0 = off), got {self.head_p}")

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, value: str) -> "HybridConfig":
        try:
            d = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV} is not JSON: {value!r}") from exc
        if not isinstance(d, dict) or set(d) - {"n_min", "n_max", "rule", "scope", "pointer", "head_p"}:
            raise ValueError(f"{ENV} must be an object with n_min, n_max, rule, scope, pointer, head_p: {value!r}")
        return cls(**d)


DEFAULT = HybridConfig()


def lookup(context: Sequence[int], k: int, n_min: int, n_max: int, limit: int | None = None) -> list[int]:
    """vLLM's n-gram proposal on ``context``: the longest suffix n-gram (``n_max`` down to ``n_min``)
    that occurred earlier, and up to ``k`` tokens that followed its earliest occurrence.

    ``limit``: only occurrences whose continuation starts before ``limit`` count, and the
    continuation stops there (``limit`` = the prompt length: look up in the prompt only)."""
    ctx = np.asarray(context, dtype=np.int64)
    L = len(ctx)
    end = L - 1 if limit is None else min(L - 1, limit)  # an occurrence must end before position `end`
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        if end - n < 0:
            continue
        suffix = ctx[L - n:]
        # windows starting at 0 .. end-n (the occurrence ends by position end-1)
        win = np.lib.stride_tricks.sliding_window_view(ctx[:end], n)
        hits = np.flatnonzero((win == suffix).all(axis=1))
        if hits.size:
            st = int(hits[0]) + n
            stop = L if limit is None else min(L, limit)
            return ctx[st:min(st + k, stop)].tolist()
    return []


SPECIAL_TEXT = "\x00"  # a special token in the prompt's text (``TokenInfo.texts``): no match crosses it


@dataclass(frozen=True, eq=False)
class TokenInfo:
    """What the ``anchor`` rule reads of each token id's text (arrays over the vocabulary).

    ``content``: a token with a letter or digit (not a special token); ``structure``: JSON punctuation
    only (no letter or digit, one of ``"{}[],:``); ``opens``: ends in ``"`` or ``["`` (opens a key or a
    string value); ``colon``: ends in ``:``; ``bracket``: ``[`` count minus ``]`` count; ``twin``: the
    same text with the leading space toggled (``"cal"`` <-> ``" cal"``) when that is one token, else -1:
    a reply's value starts without the space its word has in the shopper's sentence.

    For the ``text`` rule only: ``texts``, each token's text with a special token's as ``SPECIAL_TEXT``
    (a continuation stops there and a special token's text is never matched); ``encode(text)``: the served
    tokenizer's ids for a text (no special tokens). ``None`` where the ``TokenInfo`` was built without them."""

    content: np.ndarray
    structure: np.ndarray
    opens: np.ndarray
    colon: np.ndarray
    bracket: np.ndarray
    twin: np.ndarray
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
        return cls(content, structure, opens, colon, bracket.astype(np.int64), twin, kept, encode)

    @classmethod
    def from_tokenizer(cls, tok) -> "TokenInfo":
        V = len(tok)
        texts = [tok.decode([i]) for i in range(V)]
        return cls.from_texts(texts, tok.all_special_ids, lambda t: tok.encode(t, add_special_tokens=False))


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
MIN_VALUE_CHARS = 2  # a value's text so far shorter than this is not looked up
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


def _fold(s: str) -> str:
    """``s`` in lower case, character for character (offsets in it are offsets in ``s``)."""
    low = s.lower()
    if len(low) == len(s):  # lower() never shortens a character: equal lengths, equal offsets
        return low
    return "".join(c.lower() if len(c.lower()) == 1 else c for c in s)


def text_lookup(context: Sequence[int], prompt_len: int, k: int, info: TokenInfo) -> list[int]:
    """The ``text`` rule's extra step (module doc): inside a reply's string value, the prompt's text after
    the value's text so far (found at a word start, any case), re-encoded, up to ``k`` tokens; [] where
    the context is not inside a value or its text is not in the prompt.

    Cost per call (the runner calls it per request and step where nothing else matched): a walk back of
    at most ``VALUE_TOKENS`` tokens to the newest quote, which ends there outside a value; inside one, a
    join and a search of the prompt's text (linear in the prompt, in C) and one ``encode`` of about
    ``CONT_CHARS * k`` characters."""
    texts = info.texts
    q = value_open(context, prompt_len, info)
    if q < 0:
        return []
    value = texts[context[q]].rsplit('"', 1)[1] + "".join([texts[t] for t in context[q + 1:]])
    # At least 2 characters: the value's first token is often a whole word (the anchor's token search has
    # looked for it), and when it is 1 character long the prompt's latest word with that initial is a
    # guess that would displace a head that knows the value (an enum, a size) more often than copy it.
    # (SmolLM2 writes "navy" as "n" + "avy": such a value is helped from its second token on only.)
    # A token that does not decode alone (a byte of a multi-byte character, U+FFFD) matches nothing real.
    if (len(value) < MIN_VALUE_CHARS or not any(c.isalnum() for c in value) or "\ufffd" in value
            or SPECIAL_TEXT in value):
        return []
    P = min(prompt_len, len(context))
    text = "".join([texts[t] for t in context[:P]])
    low, needle = _fold(text), _fold(value)
    # The latest occurrence at a word start, not the earliest (as the n-gram lookup and the anchor's token
    # search take): the reply extracts the request it answers, the prompt's last message, while earlier
    # text is the system prompt ("Extract the shopper's product search ...": a value starting "pro" or
    # "se" would continue from there), earlier turns and earlier replies. A word right after a special
    # token is a chat template's role name ("<|im_start|>user"), written by no one: it does not count.
    p = low.rfind(needle)
    while p > 0 and (low[p - 1].isalnum() or low[p - 1] == SPECIAL_TEXT):
        p = low.rfind(needle, 0, p + len(needle) - 1)
    if p < 0:
        return []
    end = p + len(needle)
    # the reply writes the shopper's word in lower case ("nike" for "Nike"): so on
    return prompt_continuation(text[end:], k, info.encode, lower=value == value.lower() and text[p:end] != value)


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
                  info: TokenInfo, text: bool = False) -> list[int]:
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
            cands = {t, int(info.twin[t])} - {-1}
            for q in range(min(prompt_len, len(context)) - 1):
                if context[q] in cands:
                    look = list(context[q + 1:min(prompt_len, q + 1 + len(head))])
                    break
    if not look and text:
        look = text_lookup(context, prompt_len, len(head), info)
    return cut_at_close(look, head, info)


def cut_at_close(look: Sequence[int], head: Sequence[int], info: TokenInfo) -> list[int]:
    """``look`` up to the first position where it differs from ``head`` and the head's token is JSON
    structure: the head closes the value (or the array) there, while the prompt's sentence goes on."""
    for j in range(min(len(look), len(head))):
        if look[j] != head[j] and info.structure[head[j]]:
            return list(look[:j])
    return list(look)


def combine(head: Sequence[int], look: Sequence[int], rule: str = "lookup") -> list[int]:
    """The k draft tokens verified: the head's ``head`` (k tokens) and the lookup's ``look``
    (0..k tokens) combined by ``rule`` (module doc)."""
    head = list(head)
    look = list(look)[:len(head)]
    if rule == "head" or not look:
        return head
    if rule in ("lookup", "anchor", "text"):  # anchor, text: ``look`` is already ``anchor_lookup``'s
        return look + head[len(look):]
    if rule == "agree":
        if look[0] == head[0]:
            return head
        return look + head[len(look):]
    raise ValueError(f"unknown hybrid rule {rule!r}; choose from {RULES}")


def pointer_draft(draft: Sequence[int], head: Sequence[int], n_look: int, context: Sequence[int], prompt_len: int,
                  info: TokenInfo, pointer: Any) -> list[int]:
    """The ``pointer`` rule's step (module doc): at the first draft position that follows a value's opening
    quote (in the context or drafted) and is not the lookup's (``n_look``: how many leading positions of
    ``draft`` are), the pointer's pick (``draft.pointer.Pointer.pick``) replaces the draft from there, the
    head's tokens filling what it leaves; where it picks "no copy" the draft is kept."""
    draft = list(draft)
    k = len(draft)
    for i in range(k):
        last = draft[i - 1] if i else context[-1]
        if not info.opens[last]:
            continue
        ctx = list(context) + draft[:i]
        if value_open(ctx, prompt_len, info) != len(ctx) - 1:
            continue
        if i < n_look:  # the lookup drafts this value: the head's instead where the two agreed up to here,
            # differ on the value and the pointer says it copies nothing (an earlier turn's value for the key)
            if (draft[:i] == list(head[:i]) and draft[i] != head[i]
                    and pointer.no_copy(ctx, prompt_len, info.texts, info.encode, SPECIAL_TEXT) >= pointer.cfg.veto_p):
                return list(head)
            return draft
        pick = pointer.pick(ctx, prompt_len, k - i, info.texts, info.encode, SPECIAL_TEXT)
        pick = cut_at_close(pick, head[i:], info)
        return draft[:i] + pick + list(head[i + len(pick):])
    return draft


def gate(draft: Sequence[int], head: Sequence[int], conf: Any, head_p: float) -> list[int]:
    """``draft`` with the head's tokens from the first position where it differs from the head's ``head``,
    if the head's probability of its own token there (``conf[j]``: a sequence over the positions, or a
    mapping from the positions where it is known) is at least ``head_p`` (> 0); else ``draft``.

    Only the first difference is judged: up to it the draft is the head's own, so the head's probability
    there is the one it drafted with (in vLLM and in the simulator alike); behind a replaced token the
    head's later tokens still follow its own."""
    draft = list(draft)
    if conf is None or head_p <= 0:
        return draft
    for j in range(min(len(draft), len(head))):
        if draft[j] != head[j]:
            try:
                p = float(conf[j])
            except (IndexError, KeyError):  # not known there: no gate
                return draft
            return draft[:j] + list(head[j:]) if p >= head_p else draft
    return draft


def propose(head: Sequence[int], context: Sequence[int], prompt_len: int, cfg: HybridConfig,
            info: TokenInfo | None = None, pointer: Any = None, conf: Sequence[float] | None = None) -> list[int]:
    """One request's hybrid draft: lookup on ``context`` (prompt + output so far), combined with
    the head's ``head``, then the head's ``gate`` (``conf``: the head's probability of each of its tokens;
    None: no gate). Shared by the server and the simulator, so the two make the same choice.
    ``info``: the tokens' text, needed by the rules in ``NEEDS_TOKENS``; ``pointer``: the trained pointer
    (``draft.pointer.Pointer``), needed by rule ``pointer``."""
    return gate(_combined(head, context, prompt_len, cfg, info, pointer), head, conf, cfg.head_p)


def _combined(head: Sequence[int], context: Sequence[int], prompt_len: int, cfg: HybridConfig,
              info: TokenInfo | None = None, pointer: Any = None) -> list[int]:
    if cfg.rule == "head" or not len(head):
        return list(head)
    look = lookup(context, len(head), cfg.n_min, cfg.n_max,
                  limit=prompt_len if cfg.scope == "prompt" else None)
    if cfg.rule in NEEDS_TOKENS:
        if info is None:
            raise ValueError(f"hybrid rule {cfg.rule!r} needs the tokens' text (TokenInfo)")
        if cfg.rule in ("text", "pointer") and (info.texts is None or info.encode is None):
            raise ValueError(f"hybrid rule {cfg.rule!r} needs the tokens' texts and the tokenizer's encode "
                             "(TokenInfo.from_tokenizer, or from_texts with encode)")
        ngram = look
        look = anchor_lookup(head, context, prompt_len, look, info, text=cfg.rule in ("text", "pointer"))
    if cfg.rule == "pointer":
        if pointer is None:
            raise ValueError("hybrid rule 'pointer' needs the trained pointer (draft.pointer.Pointer)")
        if look and not ngram:  # the anchor's or the text rule's copy, inside a value the pointer says copies nothing
            q = value_open(context, prompt_len, info)
            if q >= 0 and pointer.no_copy(context[:q + 1], prompt_len, info.texts, info.encode,
                                          SPECIAL_TEXT) >= pointer.cfg.veto_p:
                look = []
        n = min(len(look), len(head))
        return pointer_draft(combine(head, look, "text"), head, n, context, prompt_len, info, pointer)
    return combine(head, look, cfg.rule)


# --- inside vLLM -------------------------------------------------------------------------------

def context_for(token_row: np.ndarray, num_tokens: int, sampled_row: Sequence[int] | None, vocab_size: int,
                ) -> list[int]:
    """A request's tokens so far: the runner's row, plus this step's accepted tokens when the
    row does not hold them yet (padded-batch mode; ``sampled_row`` ends at the first -1)."""
    ctx = token_row[:num_tokens].tolist()
    if sampled_row is not None:
        for t in sampled_row:
            t = int(t)
            if t < 0 or t >= vocab_size:
                break
            ctx.append(t)
    return ctx


def patch_runner(mod) -> bool:
    """Wrap ``GPUModelRunner.propose_draft_token_ids`` with the hybrid when ``CARTSPEC_HYBRID`` is
    set (a ``method: hybrid`` deployment); True if it was wrapped."""
    value = os.environ.get(ENV)
    if not value or getattr(mod, "_cartspec_hybrid", False) or not hasattr(mod, "GPUModelRunner"):
        return False
    cfg = HybridConfig.from_env(value)
    if cfg.rule in NEEDS_TOKENS:  # fail at start-up, not at the first draft, on a bad tokenizer
        import transformers  # noqa: F401
    if cfg.rule == "pointer":  # ... or a missing pointer
        from ..model.registry import resolve_pointer

        resolve_pointer(cfg.pointer)
    runner = mod.GPUModelRunner
    original = runner.propose_draft_token_ids

    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        method = getattr(self.speculative_config, "method", None)
        drafter = getattr(self, "drafter", None)
        hidden = record_hidden(drafter) if method == "eagle3" and cfg.head_p > 0 else None
        if hidden is not None:
            hidden.clear()
        drafts = original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        if method != "eagle3" or drafts is None:
            return drafts
        probs = None
        if hidden:
            probs = lambda pairs: head_probs(drafter, hidden, pairs)  # noqa: E731
        return hybrid_drafts(self, drafts, sampled_token_ids, cfg, runner_token_info(self, cfg),
                             runner_pointer(self, cfg), probs)

    runner.propose_draft_token_ids = propose_draft_token_ids
    mod._cartspec_hybrid = True
    print(f"cartspec: hybrid EAGLE-3 + prompt lookup drafts {cfg.to_env()} (hybrid.py)", file=sys.stderr)
    return True


def record_hidden(drafter) -> list | None:
    """Make the EAGLE drafter keep, per greedy draft position, the hidden states it takes its token from
    (``[batch, hidden]``, copied); the list it appends to, emptied by the caller before each step; None for
    a drafter without ``_greedy_sample`` (another proposer). The token choice itself is vLLM's, untouched.

    vLLM 0.32's ``SpecDecodeBaseProposer._greedy_sample`` is the one place every greedy draft token is
    chosen (the first position and each one after it); it is wrapped on the instance, once. A step whose
    tokens are chosen otherwise (probabilistic drafts) records nothing, so no gate applies there.

    Why hidden states and not probabilities: a softmax over the full vocabulary for every request and
    position costs more than the drafting it judges (``benchmarks/gate_softmax_cost.py``; the figures and
    the machine: docs/drafting.md, "How the hybrid's defaults were chosen"), while the gate needs one
    probability per request that has a copy, at most; ``head_probs`` computes just those."""
    if drafter is None or not hasattr(drafter, "_greedy_sample") or not hasattr(drafter, "model"):
        return None
    hidden = getattr(drafter, "_cartspec_hidden", None)
    if hidden is not None:
        return hidden
    original = drafter._greedy_sample
    hidden = []

    def _greedy_sample(hidden_states):
        hidden.append(hidden_states.detach().clone())
        return original(hidden_states)

    drafter._greedy_sample = _greedy_sample
    drafter._cartspec_hidden = hidden
    return hidden


def head_probs(drafter, hidden: list, pairs: Sequence[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """The head's probability of its own (greedy) token for request ``i`` at draft position ``j``, for each
    ``(i, j)`` of ``pairs``: one ``compute_logits`` over just those rows of the recorded hidden states.
    Pairs outside what was recorded are left out (no gate there)."""
    pairs = [(i, j) for i, j in pairs if j < len(hidden) and i < hidden[j].shape[0]]
    if not pairs:
        return {}
    import torch

    rows = torch.stack([hidden[j][i] for i, j in pairs])
    with torch.no_grad():
        lf = drafter.model.compute_logits(rows).float()
        p = (lf.max(dim=-1).values - lf.logsumexp(dim=-1)).exp().cpu().tolist()
    return dict(zip(pairs, p))


_TOKEN_INFO: dict[str, TokenInfo] = {}


def runner_token_info(runner, cfg: HybridConfig) -> TokenInfo | None:
    """``TokenInfo`` of the served model's tokenizer (loaded once), for the rules that need it."""
    if cfg.rule not in NEEDS_TOKENS:
        return None
    mc = runner.model_config
    path = str(getattr(mc, "tokenizer", None) or mc.model)
    if path not in _TOKEN_INFO:
        from transformers import AutoTokenizer

        _TOKEN_INFO[path] = TokenInfo.from_tokenizer(AutoTokenizer.from_pretrained(path))
    return _TOKEN_INFO[path]


_POINTER: dict[tuple[str, str], Any] = {}


def runner_pointer(runner, cfg: HybridConfig):
    """The trained pointer over the served model's embedding (loaded once), for rule ``pointer``."""
    if cfg.rule != "pointer":
        return None
    from ..model.registry import resolve_pointer

    key = (str(resolve_pointer(cfg.pointer)), str(runner.model_config.model))
    if key not in _POINTER:
        from ..draft.pointer import Pointer

        _POINTER[key] = Pointer.load(*key)
        print(f"cartspec: hybrid pointer {key[0]} over the embedding of {key[1]}", file=sys.stderr)
    return _POINTER[key]


def hybrid_drafts(runner, drafts, sampled_token_ids, cfg: HybridConfig, info: TokenInfo | None = None,
                  pointer: Any = None, probs: Any = None):
    """The head's ``drafts`` ([num_reqs, k] tensor or lists) with the lookup combined in. ``probs``: for the
    gate, ``probs([(i, j), ...]) -> {(i, j): p}``, the head's probability of request ``i``'s token at
    position ``j`` (``head_probs``); asked once per step, for each request's first position where the
    combined draft differs from the head's (None: no gate)."""
    import torch

    batch = runner.input_batch
    num_reqs = batch.num_reqs
    padded = isinstance(sampled_token_ids, torch.Tensor)
    sampled = sampled_token_ids.cpu().numpy() if padded else None
    discard = runner.discard_request_mask.np if padded else None
    as_tensor = isinstance(drafts, torch.Tensor)
    rows = drafts.cpu().tolist() if as_tensor else [list(d) for d in drafts]
    combined: dict[int, list[int]] = {}
    for i in range(min(num_reqs, len(rows))):
        if not rows[i]:
            continue
        if padded:
            srow = None if discard[i] else sampled[i]
        else:
            srow = None  # bookkeeping already appended this step's tokens
            if i < len(sampled_token_ids) and not sampled_token_ids[i]:
                continue  # no token this step (partial prefill): nothing is drafted for it
        ctx = context_for(batch.token_ids_cpu[i], int(batch.num_tokens_no_spec[i]), srow, batch.vocab_size)
        new = propose(rows[i], ctx, int(batch.num_prompt_tokens[i]), cfg, info, pointer)
        if new != rows[i]:
            combined[i] = new
    if combined and probs is not None and cfg.head_p > 0:
        firsts = {i: next((j for j, (a, b) in enumerate(zip(new, rows[i])) if a != b), len(new))
                  for i, new in combined.items()}
        p = probs(sorted(firsts.items()))
        combined = {i: gate(new, rows[i], {firsts[i]: p[(i, firsts[i])]} if (i, firsts[i]) in p else None,
                            cfg.head_p) for i, new in combined.items()}
    changed = False
    for i, new in combined.items():
        if new != rows[i]:
            rows[i] = new
            changed = True
    if not changed:
        return drafts
    if as_tensor:
        return torch.tensor(rows, dtype=drafts.dtype, device=drafts.device)
    return rows
