"""What every hybrid rule reads and shares (``drafting.rules`` re-exports it): one request's verify step
(``Step``), the ``Rule`` interface, ``overlay`` (a copy over the head's first positions) and ``vetoed`` (the
pointer says the value copies nothing). The rules' modules import these from here, and the package's
``__init__`` (``propose``, the registry of rules by name) imports the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence

from ..config import HybridConfig
from ..lookup import lookup as ngram_lookup
from ..prompt import Prompt
from ..tokens import SPECIAL_TEXT, TokenInfo, value_open


@dataclass(frozen=True)
class Step:
    """One request at one verify step: what every rule reads."""

    head: list[int]  # the head's k draft tokens
    context: Sequence[int]  # the prompt and the reply so far
    prompt_len: int
    cfg: HybridConfig
    info: TokenInfo | None = None  # the tokens' text (rules that ``needs_tokens``)
    pointer: Any = None  # the trained pointer (``drafting.pointer.Pointer``; rule ``pointer``)
    schema: Any = None  # the reply's compiled schema (``drafting.schema.SchemaGrammar``; rule ``schema``)
    prompt: Prompt | None = None  # the context's prompt (``drafting.prompt``), what the rules read of it kept

    def ngram(self) -> list[int]:
        """vLLM's n-gram lookup on the context (in the prompt only with scope ``prompt``), ``k`` tokens at most."""
        c = self.cfg
        return ngram_lookup(self.context, len(self.head), c.n_min, c.n_max,
                            limit=self.prompt_len if c.scope == "prompt" else None, prompt=self.prompt)


class Rule(Protocol):
    """A hybrid rule: ``draft`` returns the ``k`` tokens verified for one request's step."""

    name: ClassVar[str]
    needs_tokens: ClassVar[bool]  # reads ``Step.info`` (the tokens' text)
    needs_text: ClassVar[bool]  # reads ``Step.info.texts`` and ``Step.info.encode``
    needs_pointer: ClassVar[bool]
    needs_schema: ClassVar[bool] = False

    def draft(self, step: Step) -> list[int]: ...


def overlay(head: Sequence[int], look: Sequence[int]) -> list[int]:
    """``look`` over the first positions of ``head``, the head's tokens after it: k tokens."""
    head = list(head)
    look = list(look)[:len(head)]
    return look + head[len(look):]


def vetoed(context: Sequence[int], prompt_len: int, info: TokenInfo, pointer: Any,
           prompt: Prompt | None = None) -> bool:
    """The pointer says the string value the context ends inside copies nothing (at least its ``veto_p``):
    an enum that starts like a shopper's word (``"topic": "refund_window"`` for "refunds")."""
    q = value_open(context, prompt_len, info)
    return q >= 0 and pointer.no_copy(context[:q + 1], prompt_len, info.texts, info.encode,
                                      SPECIAL_TEXT, prompt=prompt) >= pointer.cfg.veto_p
