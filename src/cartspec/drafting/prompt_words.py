"""A prompt's candidate words for the pointer (``drafting.pointer``): every word start of the prompt's turns,
as written and, where different, in lower case, with its tokens and the flags that do not depend on the reply.

Computed once per prompt (``build_prompt_words``) and kept by the request's ``prompt.Prompt``; the layout of a
candidate's features (``FLAGS``, ``N_SLOTS``) is the pointer net's input, re-exported by ``drafting.pointer``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .tokens import fold

SPECIALS_AFTER = 6  # one-hot of the special tokens between a word and the prompt's end (0..5, 6+ together)
FLAGS = ("capital", "digit", "lowered", "in_reply", "is_key", "after_key", "segment_start", "segment_pos",
         "words_to_end") + tuple(f"specials_{i}" for i in range(SPECIALS_AFTER + 1))
N_SLOTS = 4  # tokens per candidate: its first token, the two before it, the one after it
MAX_CANDIDATES = 96  # the latest word starts of a long prompt


@dataclass
class PromptWords:
    """What ``pointer.candidates`` reads of a prompt, computed once per prompt (``pointer.prompt_words``): the
    candidates' starts, lower-case offers, folded words and previous words, tokens and the flags that do not
    depend on the reply."""

    text: str
    starts: list[int]
    lowered: list[bool]
    words: list[str]
    prev_words: list[str]
    tokens: np.ndarray
    flags: np.ndarray
    # what a pointer computes once per prompt (``Pointer.probs``: its candidates' share of the first layer)
    memo: dict = field(default_factory=dict, repr=False, compare=False)


_ALNUM_RUN = re.compile(r"[^\W_]*")  # letters and digits: ``str.isalnum``'s characters are ``\w``'s but "_"
_WORD_STARTS: dict[str, re.Pattern] = {}


def _word_start(special: str) -> re.Pattern:
    """A letter or digit after anything but a letter, a digit or ``special`` (or at the text's start)."""
    pat = _WORD_STARTS.get(special)
    if pat is None:
        pat = _WORD_STARTS[special] = re.compile(r"(?<![^\W_])(?<!" + re.escape(special) + r")[^\W_]")
    return pat


def build_prompt_words(prompt: Sequence[int], texts: Sequence[str], special: str) -> PromptWords:
    """Every word start of the prompt's text (a letter or digit after anything else, not right after a
    special token: a chat template's role name), the latest ``MAX_CANDIDATES``; each as written and, where
    different, in lower case."""
    P = len(prompt)
    pieces = [texts[t] for t in prompt]
    offs = np.cumsum([0] + [len(p) for p in pieces])
    text = "".join(pieces)
    low = fold(text)
    sp_pos = np.array([m.start() for m in re.finditer(re.escape(special), text)], dtype=np.int64)
    # a system message's words are not the shopper's: its role name is the word right after a special token
    system = [(int(p), int(sp_pos[n + 1]) if n + 1 < len(sp_pos) else len(text)) for n, p in enumerate(sp_pos)
              if low.startswith("system", p + 1) and not low[p + 7:p + 8].isalnum()]
    # a letter or digit after anything else (``str.isalnum`` is ``\w`` without "_"), not right after a special token
    starts = np.array([m.start() for m in _word_start(special).finditer(text)], dtype=np.int64)
    for a, b in system:
        starts = starts[(starts <= a) | (starts >= b)]
    starts = starts[-MAX_CANDIDATES:]
    seg_of = np.searchsorted(sp_pos, starts)  # the segment (between special tokens) each start is in
    # per start: its token, where its segment's starts begin and how many it has (seg_of is sorted)
    tis = (np.searchsorted(offs, starts, side="right") - 1).tolist()
    seg_first = np.searchsorted(seg_of, seg_of, side="left").tolist()
    seg_count = (np.searchsorted(seg_of, seg_of, side="right") - np.asarray(seg_first, dtype=np.int64)).tolist()
    afters = (len(sp_pos) - seg_of).tolist()
    starts = starts.tolist()
    rows, flags, st_out, lowered, words, prevs = [], [], [], [], [], []
    prev_word = ""
    for n, i in enumerate(starts):
        e = _ALNUM_RUN.match(text, i).end()
        word, fw = text[i:e], low[i:e]
        ti = tis[n]
        toks = [prompt[ti], prompt[ti - 1] if ti >= 1 else -1, prompt[ti - 2] if ti >= 2 else -1,
                prompt[ti + 1] if ti + 1 < P else -1]
        after = afters[n]
        k_in, n_seg = n - seg_first[n], seg_count[n]
        base = [float(word[:1].isupper()), float(word[:1].isdigit()), 0.0, 0.0, 0.0, 0.0,
                float(k_in == 0), k_in / max(1, n_seg - 1), min(n_seg - 1 - k_in, 16) / 16]
        onehot = [0.0] * (SPECIALS_AFTER + 1)
        onehot[min(after, SPECIALS_AFTER)] = 1.0
        pw = prev_word if k_in else ""
        for lw in ((False, True) if word != fw else (False,)):
            f = base + onehot
            f[2] = float(lw)
            rows.append(toks)
            flags.append(f)
            st_out.append(i)
            lowered.append(lw)
            words.append(fw)
            prevs.append(pw)
        prev_word = fw
    return PromptWords(text, st_out, lowered, words, prevs, np.asarray(rows, dtype=np.int64).reshape(-1, N_SLOTS),
                       np.asarray(flags, dtype=np.float32).reshape(-1, len(FLAGS)))
