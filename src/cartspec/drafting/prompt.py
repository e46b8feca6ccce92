"""One request's prompt and what the copy rules read of it, computed once per prompt rather than per step.

A hybrid rule runs at every verify step of every request, and most of what it reads of the prompt does not
change over a reply: the prompt's text (its tokens' texts joined) and that text in lower case, where each
token first occurs, the n-gram index of vLLM's lookup (``prompt_index``) and the pointer's candidate
words (``prompt_words``). A ``Prompt`` computes each on first use and keeps it.

The vLLM runner keeps one ``Prompt`` per request (``vllm_plugin.hybrid``, by request id) and hands it to the
rules with the context; the simulator and the tests leave it out and ``prompt_of`` finds it by the prompt's
tokens (kept for the latest ``PROMPT_CACHE`` prompts), which costs a tuple of the prompt per call.
"""

from __future__ import annotations

from typing import Any, Sequence

PROMPT_CACHE = 512  # prompts kept by ``prompt_of`` (a server's requests in flight, a simulator's sequence)


class Prompt:
    """A prompt's token ids (``tokens``) and, computed on first use, what the rules read of it."""

    __slots__ = ("tokens", "_texts", "_text", "_folded", "_first", "_index", "_words")

    def __init__(self, tokens: Sequence[int]):
        self.tokens: tuple[int, ...] = tuple(int(t) for t in tokens)
        self._texts: Any = None  # the ``texts`` the text was joined from (a served model has one)
        self._text = self._folded = None
        self._first: dict[int, int] | None = None
        self._index: dict[tuple[int, int], Any] = {}
        self._words: dict[tuple[int, str], Any] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def text(self, texts: Sequence[str]) -> str:
        """The tokens' texts joined (``TokenInfo.texts``: a special token's is ``SPECIAL_TEXT``)."""
        if self._text is None or self._texts is not texts:
            self._texts, self._folded = texts, None
            self._text = "".join([texts[t] for t in self.tokens])
        return self._text

    def folded(self, texts: Sequence[str]) -> str:
        """``text`` in lower case, offset for offset (``tokens.fold``)."""
        text = self.text(texts)
        if self._folded is None:
            from .tokens import fold

            self._folded = fold(text)
        return self._folded

    def first(self, token: int) -> int:
        """The position of ``token``'s first occurrence, -1 where it does not occur."""
        if self._first is None:
            first: dict[int, int] = {}
            for q, t in enumerate(self.tokens):
                first.setdefault(t, q)
            self._first = first
        return self._first.get(token, -1)

    def index(self, n_min: int, n_max: int):
        """vLLM's n-gram lookup's index of this prompt (``prompt_index.PromptIndex``)."""
        idx = self._index.get((n_min, n_max))
        if idx is None:
            from .prompt_index import PromptIndex

            idx = self._index[(n_min, n_max)] = PromptIndex(self.tokens, n_min, n_max)
        return idx

    def words(self, texts: Sequence[str], special: str):
        """The pointer's candidate words of this prompt (``prompt_words.PromptWords``)."""
        key = (id(texts), special)
        pw = self._words.get(key)
        if pw is None:
            from .prompt_words import build_prompt_words

            pw = self._words[key] = build_prompt_words(self.tokens, texts, special)
        return pw


_PROMPTS: dict[tuple[int, ...], Prompt] = {}


def prompt_of(context: Sequence[int], prompt_len: int, prompt: Prompt | None = None) -> Prompt:
    """``prompt`` where given and it is the context's (its length is ``prompt_len``, or the context's where that
    is shorter); else the ``Prompt`` of ``context[:prompt_len]``, found by its tokens or made and kept."""
    P = min(prompt_len, len(context))
    if prompt is not None and len(prompt) == P:
        return prompt
    key = tuple(context[:P]) if not hasattr(context, "tolist") else tuple(context[:P].tolist())
    hit = _PROMPTS.get(key)
    if hit is None:
        if len(_PROMPTS) >= PROMPT_CACHE:
            _PROMPTS.pop(next(iter(_PROMPTS)))
        hit = _PROMPTS[key] = Prompt(key)
    return hit


def clear() -> None:
    """Forget every prompt ``prompt_of`` kept (a benchmark's cold start)."""
    _PROMPTS.clear()
