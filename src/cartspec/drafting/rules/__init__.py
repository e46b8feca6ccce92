"""The hybrid's rules: how the head's draft and the copies of the prompt combine, one file per rule.

Every rule is a ``Rule``: ``draft(step)`` takes one request's verify step (``Step``: the head's ``k`` draft
tokens, the context, the prompt's length, the tokens' text and the pointer where the rule needs them) and
returns the ``k`` tokens to verify. ``propose`` runs the configured rule, then the head's gate
(``drafting.gate``). The simulator (``draft.simulate``) and the vLLM plugin (``vllm_plugin.hybrid``) both
call ``propose``, so the two make the same choice.

The rules, each extending the one before where it lost a token class (the measurements that chose and
retired them: docs/archive/2026-12-drafting-research.md and docs/experiments.md):

* ``head``: the head's draft alone (the hybrid then equals EAGLE-3; the fallback where no pointer exists).
* ``lookup``: vLLM's n-gram lookup in the prompt overrides the head where it matches.
* ``agree``: ``lookup``, but the head's draft stays whole where the lookup's first token is the head's.
* ``anchor``: ``lookup`` plus a value's first token looked up alone (``copying.anchor_lookup``).
* ``text``: ``anchor`` plus the value's text found in the prompt's text (``copying.text_lookup``).
* ``pointer`` (the default): ``text`` plus a trained pointer that picks which word a value copies.
* ``schema``: the head's draft checked against the reply's JSON schema (``drafting.schema``): the schema
  drafter's copies in short values and its drafts from the first token the grammar refuses.
* ``pointer-schema``: ``pointer``'s draft checked against the schema the same way.

``lookup``, ``agree``, ``anchor`` and ``text`` are kept as baselines of the tests and the simulator; none of
them drafted above the head alone on hand-written requests.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..config import HybridConfig
from ..copying import number_lookup, splice, word_rest
from ..gate import gate as head_gate
from ..prompt import Prompt, prompt_of
from ..tokens import TokenInfo
from .step import Rule, Step, overlay, vetoed  # noqa: F401 (re-exported: what every rule reads and shares)


def _registry() -> dict[str, Rule]:
    from .agree import Agree
    from .anchor import Anchor
    from .head import Head
    from .lookup import Lookup
    from .pointer import PointerRule
    from .pointer_schema import PointerSchema
    from .schema import SchemaRule
    from .text import Text

    return {r.name: r for r in (Lookup(), Agree(), Head(), Anchor(), Text(), PointerRule(), SchemaRule(),
                                PointerSchema())}


# every rule object by name; ``config.RULES`` names the same rules (a test holds the two together)
BY_NAME: dict[str, Rule] = _registry()


def check(step: Step, rule: Rule) -> None:
    """Refuse a step that lacks what the rule reads (a ValueError naming it)."""
    if rule.needs_tokens and step.info is None:
        raise ValueError(f"hybrid rule {rule.name!r} needs the tokens' text (TokenInfo)")
    if rule.needs_text and (step.info.texts is None or step.info.encode is None):
        raise ValueError(f"hybrid rule {rule.name!r} needs the tokens' texts and the tokenizer's encode "
                         "(TokenInfo.from_tokenizer, or from_texts with encode)")
    if rule.needs_pointer and step.pointer is None:
        raise ValueError(f"hybrid rule {rule.name!r} needs the trained pointer (drafting.pointer.Pointer)")
    if getattr(rule, "needs_schema", False) and step.schema is None:
        raise ValueError(f"hybrid rule {rule.name!r} needs the reply's compiled schema (drafting.schema.SchemaGrammar)")


def base(head: Sequence[int], context: Sequence[int], prompt_len: int, cfg: HybridConfig,
         info: TokenInfo | None = None, pointer: Any = None, prompt: Prompt | None = None) -> list[int]:
    """The draft a rule starts from and the gate judges against: the head's, and for a rule that reads the
    tokens' texts (``needs_text``) what the prompt fixes and the head is not to judge, over its first
    positions with its close after them (``copying.splice``):

    * inside a number value, the rest of the prompt's number (``copying.number_lookup``);
    * inside a string value that ends within a prompt word, the rest of that word (``copying.word_rest``:
      ``use`` after ``chartre`` of "chartreuse", where the head, sure of a value it never saw, closes it);
      not where the head goes on as an identifier (``"price`` + ``_asc``), nor where the rule's pointer
      says the value copies nothing (``vetoed``)."""
    head = list(head)
    rule = BY_NAME.get(cfg.rule)
    if head and rule is not None and rule.needs_text and info is not None and info.texts is not None:
        number = number_lookup(context, prompt_len, len(head), info, prompt)
        if number:
            return splice(head, number, info)
        rest = word_rest(context, prompt_len, len(head), info, prompt)
        if rest and not (rule.needs_pointer and pointer is not None
                         and vetoed(context, prompt_len, info, pointer, prompt)):
            return splice(head, rest, info)
    return head


def combine(head: Sequence[int], context: Sequence[int], prompt_len: int, cfg: HybridConfig,
            info: TokenInfo | None = None, pointer: Any = None, schema: Any = None,
            prompt: Prompt | None = None) -> tuple[list[int], list[int]]:
    """One request's hybrid draft before the gate, and the ``base`` it was made from (what the gate judges it
    against: the head's tokens beyond what ``base`` copied). ``prompt``: the context's ``Prompt`` where the
    caller keeps one per request (the vLLM runner); else it is found by the prompt's tokens."""
    prompt = prompt_of(context, prompt_len, prompt)
    start = base(head, context, prompt_len, cfg, info, pointer, prompt)
    return draft(Step(start, context, prompt_len, cfg, info, pointer, schema, prompt)), start


def propose(head: Sequence[int], context: Sequence[int], prompt_len: int, cfg: HybridConfig,
            info: TokenInfo | None = None, pointer: Any = None, conf: Any = None, schema: Any = None,
            prompt: Prompt | None = None) -> list[int]:
    """One request's hybrid draft: ``cfg.rule``'s draft (``combine``), then the head's ``gate`` (``conf``: the
    head's probability of each of its tokens, a sequence or a mapping from positions; None: no gate;
    ``schema``: the request's ``SchemaGrammar``, for the rules that follow a schema)."""
    new, start = combine(head, context, prompt_len, cfg, info, pointer, schema, prompt)
    return head_gate(new, start, conf, cfg.head_p)


def draft(step: Step) -> list[int]:
    """``step.cfg.rule``'s draft, before the gate."""
    rule = BY_NAME.get(step.cfg.rule)
    if rule is None:
        raise ValueError(f"unknown hybrid rule {step.cfg.rule!r}; choose from {tuple(BY_NAME)}")
    if not step.head:
        return []
    check(step, rule)
    return rule.draft(step)
