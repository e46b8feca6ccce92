"""What ``cartspec serve`` deploys when it is not given a spec: the default deployment and its adaptive form.

``default_spec`` is also what the agent drills and benchmarks start, so that they measure the
deployment a user gets from ``cartspec serve``.
"""

from __future__ import annotations

import logging
from typing import Callable

# What `serve` drafts with by default (the hybrid) and where it falls back to the head alone:
# drafting.config's DEFAULT_DRAFT and default_draft, which `draft gate` measures with as well.
from ..drafting.config import DEFAULT_DRAFT
from ..drafting.length import METHODS as STOP_METHODS
from ..serving.spec import DeploymentSpec, Speculative

DRAFTS = ("eagle3", "hybrid", "schema")
NO_HEAD_DRAFT = "schema"  # a target without a head: the schema drafter, which needs none

Say = Callable[[str], None]


def _warn(message: str) -> None:
    logging.getLogger("cartspec.agent").warning(message)


def default_spec(model: str, head: str, gamma: int, enforce_eager: bool, dtype: str = "auto",
                 draft: str = DEFAULT_DRAFT, say: Say = _warn, pointer: str | None = None,
                 draft_stop: float | None = None) -> DeploymentSpec:
    """The deployment ``serve`` runs: the commerce target; the domain head at γ=``gamma`` when the head is
    there, drafting with ``draft`` (eagle3, or hybrid: the head plus the prompt's copies with the rule
    ``drafting.config.default_rule`` gives the target and head; eagle3 where ``drafting.config.default_draft``
    says that is the head alone); a target
    without a head (``head`` auto and none trained for it), or ``draft`` schema: the schema drafter at
    γ=``gamma`` (drafts from the replies' JSON schema and the prompt); ``head`` none: no speculation. ``pointer``: the hybrid's pointer for this target (default: the bundled one where it was
    trained for it). ``draft_stop``: with eagle3 or hybrid, each request's draft cut where the head's path probability falls
    below it (``drafting.length``). ``say``: where a warning
    goes (no head for this target: served without speculation)."""
    from ..model.convert import ModelNotFound
    from ..model.registry import matching_bundled_head, resolve_head, resolve_model

    speculative = Speculative()
    if head == "auto" and draft != NO_HEAD_DRAFT:  # only a bundled head trained for this target (or its base)
        try:
            head = matching_bundled_head(resolve_model(model)) or NO_HEAD_DRAFT
        except ModelNotFound as exc:
            say(str(exc))
            head = "none"
        if head == NO_HEAD_DRAFT:
            say(f"no bundled head was trained for {model}: drafting from the replies' JSON schema and the prompt "
                "(the schema drafter, which needs no head; train a head: cartspec draft train --target MODEL "
                "--prompts FILE.jsonl)")
    if draft_stop is not None and (head in ("none", NO_HEAD_DRAFT) or draft not in STOP_METHODS):
        raise ValueError("--draft-stop cuts by an EAGLE-3 head's probabilities: it needs --draft eagle3 or hybrid "
                         f"and a head (here: draft {draft}, head {head})")
    if head == NO_HEAD_DRAFT or draft == NO_HEAD_DRAFT:
        speculative = Speculative(method="schema", num_speculative_tokens=gamma)
    elif head != "none":
        from ..drafting.config import DEFAULT, NO_POINTER, HybridConfig, default_draft

        head_dir = resolve_head(head)
        # the hybrid where its default rule for this target and head uses a pointer (given, the head's own or
        # the one trained for the target); else it would draft as the head alone, at the hybrid's cost
        if draft == "hybrid" and default_draft(resolve_model(model), head_dir, pointer) != "hybrid":
            say(f"{NO_POINTER}; serving the head alone (--draft eagle3)")
            draft = "eagle3"
        # the target's default rule is the spec's default (no hybrid block); a pointer given is written out
        hybrid = HybridConfig(rule=DEFAULT.rule, pointer=pointer) if pointer and draft == "hybrid" else None
        speculative = Speculative(method=draft, model=head, num_speculative_tokens=gamma, hybrid=hybrid,
                                  draft_stop=draft_stop)
    # Per-request timing metrics give the trace vLLM's own queue time and TTFT.
    return DeploymentSpec(model=model, speculative=speculative, enforce_eager=enforce_eager, dtype=dtype,
                          engine_args=["--enable-per-request-metrics"])


def adaptive_request(spec: DeploymentSpec) -> DeploymentSpec:
    """``spec`` asking for a γ-per-batch-size schedule instead of its fixed γ: what a tuner fills in
    (``bench.sweep.serving_schedule`` in ``cartspec serve --adaptive``). The schedule is the head's own,
    so only an EAGLE-3 head drafting alone can take one."""
    sp = spec.speculative
    if sp.method != "eagle3":
        raise ValueError("--adaptive needs an EAGLE-3 head (--head) drafting alone (--draft eagle3)")
    return spec.model_copy(update={"speculative": sp.model_copy(update={"adaptive": True,
                                                                       "num_speculative_tokens": None})})
