"""Drafting rules: plain numpy/torch code that turns a head's draft and the prompt into the tokens verified.

Shared by the simulator (``draft.simulate``), the acceptance measurement and the vLLM plugin
(``vllm_plugin.hybrid``), so that what is measured offline is what the engine drafts.

* ``config``: ``HybridConfig``, the one default (``DEFAULT``) and the rule a target gets (``default_rule``).
* ``rules``: the ``Rule`` interface, one file per rule, and ``propose`` (a rule, then the gate).
* ``lookup``: vLLM's n-gram lookup. ``copying``: where a value's copy comes from in the prompt.
* ``prompt``: one request's prompt and what the rules read of it, computed once per prompt.
* ``tokens``: what the copy rules read of each token's text. ``gate``: the head's gate.
* ``pointer``: the trained pointer (which word of the prompt a value copies); trained by ``draft.pointer``.
* ``schema``: the schema drafter (a reply followed through its JSON schema's grammar; no head), alone
  (vLLM's ``custom_class``, ``vllm_plugin.schema``) or with a head (rule ``schema``).
"""

from .config import DEFAULT, HEAD_P, KEY, NEEDS_TOKENS, RULES, HybridConfig, default_rule  # noqa: F401
from .gate import gate  # noqa: F401
from .lookup import lookup  # noqa: F401
from .prompt import Prompt  # noqa: F401
from .rules import Rule, Step, propose  # noqa: F401
from .tokens import SPECIAL_TEXT, TokenInfo, value_open, value_start  # noqa: F401

__all__ = ["DEFAULT", "HEAD_P", "KEY", "NEEDS_TOKENS", "RULES", "HybridConfig", "default_rule", "gate", "lookup",
           "Prompt", "Rule", "Step", "propose", "SPECIAL_TEXT", "TokenInfo", "value_open", "value_start"]
