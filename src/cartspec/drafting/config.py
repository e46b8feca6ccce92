"""The hybrid's settings: which rule combines the head's draft with the copies, and its knobs.

One default everywhere: a hybrid given no settings runs ``HybridConfig(rule=default_rule(target))`` in
``cartspec serve``, in ``cartspec draft acceptance --method hybrid`` and in the study's ``hybrid:HEAD:γ``,
and every acceptance report and study point records the settings it ran. The default rule is ``pointer``
(``DEFAULT``); a target for which no pointer was trained gets rule ``head`` instead: the other copy rules
drafted below the head alone on requests no generator wrote (docs/drafting.md, "Hybrid drafts"). Rule
``pointer-schema`` drafted more on requests no generator wrote (novel set in vLLM at f81e7b5: τ 3.41, copied
values 81%, against 3.31 and 72%) but its grammar check cost 10 ms a step at six requests in the engine, more
than its τ gain bought on the commerce traffic (docs/archive/2026-12-drafting-research.md), so it is not the
default; since rule ``pointer`` copies a number's and a word's rest (11026e5) it reaches τ 3.40 and 81% there itself.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# where a deployment's hybrid settings travel into vLLM: its ``--additional-config`` (vLLM's ``additional_config``,
# the settings it keeps for plugins), as ``{KEY: HybridConfig.to_dict()}``
KEY = "cartspec_hybrid"
RULES = ("lookup", "agree", "head", "anchor", "text", "pointer", "schema", "pointer-schema")
NEEDS_TOKENS = ("anchor", "text", "pointer", "pointer-schema")  # rules that read the tokens' text (``TokenInfo``)
NEEDS_POINTER = ("pointer", "pointer-schema")  # rules that read the trained pointer
NEEDS_SCHEMA = ("schema", "pointer-schema")  # rules that follow the reply's JSON schema
SCOPES = ("prompt", "context")
# ``HybridConfig.head_p`` where it is not given: chosen for rule ``pointer`` in the simulator on the dev split's
# greedy replies (module doc); the other rules keep the drafts they were measured with
HEAD_P = {"pointer": 0.9, "pointer-schema": 0.9}


@dataclass(frozen=True)
class HybridConfig:
    """The hybrid's settings (module doc); ``pointer`` "" is the pointer trained for the served target."""

    n_min: int = 3
    n_max: int = 4
    rule: str = "pointer"
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
        if self.pointer and self.rule not in NEEDS_POINTER:
            raise ValueError(f"a hybrid's pointer is a setting of the rules that read one: {', '.join(NEEDS_POINTER)}")

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, value: dict | str) -> "HybridConfig":
        """From ``to_dict`` (or its JSON): what vLLM's ``additional_config`` carries under ``KEY``."""
        d = value
        if isinstance(value, str):
            try:
                d = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the hybrid's settings are not JSON: {value!r}") from exc
        if not isinstance(d, dict) or set(d) - {"n_min", "n_max", "rule", "scope", "pointer", "head_p"}:
            raise ValueError(f"the hybrid's settings must be an object with n_min, n_max, rule, scope, pointer, "
                             f"head_p: {value!r}")
        return cls(**d)


DEFAULT = HybridConfig()


NO_POINTER = ("no pointer was trained for this target, so the hybrid drafts as the head alone (rule head): "
              "the copy rules without a pointer drafted below the head alone on hand-written requests; "
              "train one with `cartspec draft pointer --target MODEL`")


def default_rule(model_dir: Path | str | None, pointer: str | None = None) -> str:
    """The rule a hybrid runs where none is given: ``DEFAULT.rule`` (``pointer``) where a pointer is given or
    the bundled one was trained for the target in ``model_dir``, else ``head`` (``NO_POINTER`` says why).
    ``serve``, ``draft acceptance`` and the study's deployments all resolve the rule here."""
    if pointer:
        return DEFAULT.rule
    if model_dir is None:
        return DEFAULT.rule
    from ..model.registry import matching_bundled_pointer

    return DEFAULT.rule if matching_bundled_pointer(Path(model_dir)) else "head"


# What `serve` drafts with by default: the hybrid (EAGLE-3 head plus prompt lookup, with the pointer where one
# was trained for the served model or with the head), which accepts the most tokens per step of the bundled
# drafters; its throughput against the head alone, with the command and the machine: docs/drafting.md,
# "The hybrid against the head in throughput".
DEFAULT_DRAFT = "hybrid"


def default_draft(model_dir: Path | str | None, head_dir: Path | str | None = None,
                  pointer: str | None = None) -> str:
    """The drafter ``serve`` deploys with a head when none is asked: ``DEFAULT_DRAFT`` (``hybrid``) where its
    rule for this target (``default_rule``, with ``pointer``, else the head's own, else the bundled one) uses
    a pointer, else ``eagle3``: a hybrid without a pointer drafts as the head alone, at the hybrid's cost
    (``NO_POINTER``). ``serve`` (``agent.defaults.default_spec``) and ``draft gate`` both decide here."""
    from ..model.registry import head_pointer

    own = head_pointer(head_dir)
    return "eagle3" if default_rule(model_dir, pointer or (str(own) if own else None)) == "head" else DEFAULT_DRAFT


def for_target(cfg: HybridConfig | None, model_dir: Path | str | None,
               head_dir: Path | str | None = None) -> HybridConfig:
    """``cfg``, or the target's default where None (``default_rule``), with the pointer resolved to its
    directory where the rule is ``pointer``: ``""`` is the pointer kept in the head's own directory
    (``model.registry.head_pointer``: a refreshed version's, trained with its head) where ``head_dir`` has
    one, else the bundled one. What a deployment, the simulator and ``draft acceptance`` run. Raises
    ``ModelNotFound`` for a pointer that is not there."""
    from ..model.registry import head_pointer, resolve_pointer

    own = head_pointer(head_dir)
    cfg = cfg if cfg is not None else HybridConfig(rule=default_rule(model_dir, str(own) if own else None))
    if cfg.rule in NEEDS_POINTER:
        cfg = replace(cfg, pointer=str(resolve_pointer(cfg.pointer or (str(own) if own else None))))
    return cfg
