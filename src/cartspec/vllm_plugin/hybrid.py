"""Patch ``hybrid``: the hybrid drafter inside vLLM's model runner (the rules: ``drafting.rules``).

Where it plugs into vLLM 0.32 (as installed)
--------------------------------------------
vLLM's ``custom_class`` speculative method cannot do this: the runner calls a
custom proposer's ``propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, slot_mappings=...)`` with token ids only
(``GPUModelRunner.propose_draft_token_ids``), never the target's hidden states,
and an EAGLE-3 head drafts from the target's aux hidden states. So the server
runs method ``eagle3`` and cartspec wraps ``GPUModelRunner.propose_draft_token_ids``
(``apply``, through cartspec's vLLM plugin, which vLLM loads in every process): the wrapper calls the original
(the head's ``[num_reqs, k]`` draft tensor), runs the lookup per request and
returns the combined tensor. The settings travel in vLLM's ``additional_config``
(``--additional-config '{"cartspec_hybrid": {...}}'``, the settings vLLM keeps for plugins), which
``VllmServer`` sets for a ``method: hybrid`` deployment: vLLM's ``SpeculativeConfig`` is a pydantic
dataclass that rejects keys it does not know. A runner without them drafts as vLLM does.

The gate needs the head's probability of the token it drafted, which vLLM's drafter never computes (it
takes an argmax). The drafter's ``_greedy_sample`` (vLLM 0.32's one place where each greedy draft token is
chosen, the first position and each after it) is wrapped on the instance by patch ``draft_vocab`` (``record_logits``):
the head's draft-vocabulary logits and their argmax (vLLM's token), from one product with the head's
output layer, where vLLM's own would also spread them over the target's vocabulary. The gate computes
the probability (``recorded_probs``) only for each request's first position where the combined draft
differs from the head's, from those kept logits. For a drafter ``record_logits`` cannot read (vLLM's local-argmax or
heterogeneous-vocabulary modes) ``record_hidden`` keeps the hidden states instead and ``head_probs``
computes just the rows asked (one ``compute_logits`` per step). Where the drafter samples its drafts
nothing is recorded and no gate applies.

In eagle's padded-batch mode (vLLM's default) the drafter runs *before* the
runner's bookkeeping: ``input_batch.token_ids_cpu`` / ``num_tokens_no_spec`` do
not yet hold this step's accepted tokens, which are in ``sampled_token_ids``
([num_reqs, k+1], -1 after the first rejection). The wrapper appends them
(``context_for``). With ``disable_padded_drafter_batch`` the drafter runs after
bookkeeping and gets lists; the token rows are then already complete.

The wrap is applied in every vLLM process. With the pinned vLLM, where it does not apply, vLLM fails to
start with the reason (``registry.PatchError``); with another vLLM it is reported ``failed``, and
``VllmServer`` refuses a hybrid deployment whose log says so.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Sequence

import numpy as np

from ..drafting.config import KEY, NEEDS_POINTER, NEEDS_SCHEMA, NEEDS_TOKENS, HybridConfig
from ..drafting.rules import combine
from ..drafting.gate import gate
from ..drafting.length import first_copy
from ..drafting.prompt import Prompt
from ..drafting.tokens import TokenInfo
from .draft_vocab import draft_targets, probs_of, record_logits
from .registry import Patch, Target
from .schema import runner_schemas

MODULE = "vllm.v1.worker.gpu_model_runner"


def context_for(token_row: np.ndarray, num_tokens: int, sampled_row: Sequence[int] | None, vocab_size: int,
                prompt: Prompt | None = None) -> list[int]:
    """A request's tokens so far: the runner's row, plus this step's accepted tokens when the
    row does not hold them yet (padded-batch mode; ``sampled_row`` ends at the first -1). ``prompt``: the
    row's first tokens as the runner keeps them (``request_prompt``), then only the reply is read from the row."""
    if prompt is not None and len(prompt) <= num_tokens:
        ctx = list(prompt.tokens)
        ctx.extend(token_row[len(prompt):num_tokens].tolist())
    else:
        ctx = token_row[:num_tokens].tolist()
    if sampled_row is not None:
        for t in sampled_row:
            t = int(t)
            if t < 0 or t >= vocab_size:
                break
            ctx.append(t)
    return ctx


def needed() -> str | None:
    return None  # wrapped in every process; it drafts only in a runner whose vLLM config asks (``runner_config``)


def runner_config(runner) -> HybridConfig | None:
    """The hybrid's settings of this runner's deployment: vLLM's ``additional_config`` under ``KEY``, read once
    per runner; None for a deployment that is not a hybrid (the wrapper then passes the head's draft on)."""
    from .settings import runner_setting

    return runner_setting(runner, KEY, HybridConfig.from_dict,
                          lambda cfg: f"cartspec: hybrid drafts in this runner: {cfg.to_json()}")


def apply(mod) -> None:
    """Wrap ``GPUModelRunner.propose_draft_token_ids``: in a hybrid deployment (``runner_config``) the head's
    draft is combined with the prompt's copies; elsewhere it passes through."""
    runner = mod.GPUModelRunner
    original = runner.propose_draft_token_ids

    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        cfg = runner_config(self)
        if cfg is None:
            return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        self._cartspec_copies = {}  # this step's copies (``hybrid_drafts``), for patch draft_stop's cut
        method = getattr(self.speculative_config, "method", None)
        drafter = getattr(self, "drafter", None)
        gated = method == "eagle3" and cfg.head_p > 0
        recorded = record_logits(drafter) if gated else None
        hidden = record_hidden(drafter) if gated and recorded is None else None
        for kept in (recorded, hidden):
            if kept is not None:
                kept.clear()
        if recorded is not None:
            drafter._cartspec_recording = True
        drafts = original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        if method != "eagle3" or drafts is None:
            return drafts
        probs = None
        if recorded:
            probs = lambda pairs: recorded_probs(recorded, pairs)  # noqa: E731
        elif hidden:
            probs = lambda pairs: head_probs(drafter, hidden, pairs)  # noqa: E731
        return hybrid_drafts(self, drafts, sampled_token_ids, cfg, runner_token_info(self, cfg),
                             runner_pointer(self, cfg), probs)

    runner.propose_draft_token_ids = propose_draft_token_ids


def record_hidden(drafter) -> list | None:
    """Make the EAGLE drafter keep, per greedy draft position, the hidden states it takes its token from
    (``[batch, hidden]``, copied); the list it appends to, emptied by the caller before each step; None for
    a drafter without ``_greedy_sample`` (another proposer). The token choice itself is vLLM's, untouched.

    vLLM 0.32's ``SpecDecodeBaseProposer._greedy_sample`` is the one place every greedy draft token is
    chosen (the first position and each one after it); it is wrapped on the instance, once. A step whose
    tokens are chosen otherwise (probabilistic drafts) records nothing, so no gate applies there.

    Why hidden states and not probabilities: a softmax over the full vocabulary for every request and
    position costs more than the drafting it judges (``benchmarks/gate_softmax_cost.py``; the figures and
    the machine: docs/archive/2026-12-drafting-research-length-and-throughput.md, "How the hybrid's defaults
    were chosen"), while the gate needs one probability per request that has a copy, at most; ``head_probs``
    computes just those."""
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


def recorded_probs(recorded: list, pairs: Sequence[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """``head_probs`` from the logits ``draft_vocab.record_logits`` kept while the head drafted (per position,
    ``[batch, vocab]``, with its choice the argmax of each row): the probability of request ``i``'s token at
    position ``j`` for just the pairs asked, in one ``probs_of``. Pairs outside what was recorded are left
    out (no gate there)."""
    import torch

    pairs = [(i, j) for i, j in pairs if j < len(recorded) and i < recorded[j].shape[0]]
    if not pairs:
        return {}
    p = probs_of(torch.stack([recorded[j][i] for i, j in pairs])).tolist()
    return dict(zip(pairs, p))


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
        model = drafter.model
        if draft_targets(model) is not None:
            # the head's draft vocabulary's logits, before vLLM spreads them over the target's (-inf elsewhere):
            # the same probability of its argmax, a sixth of the softmax (``draft_vocab.draft_targets``)
            lf = model.logits_processor(model.lm_head, rows).float()
        else:
            lf = model.compute_logits(rows).float()
        p = probs_of(lf).cpu().tolist()
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
    if cfg.rule not in NEEDS_POINTER:
        return None
    key = (cfg.pointer, str(runner.model_config.model))  # asked every step: resolved and loaded once
    if key not in _POINTER:
        from ..drafting.pointer import Pointer
        from ..model.registry import resolve_pointer

        path = str(resolve_pointer(cfg.pointer))
        _POINTER[key] = Pointer.load(path, key[1])
        print(f"cartspec: hybrid pointer {path} over the embedding of {key[1]}", file=sys.stderr)
    return _POINTER[key]


def request_prompts(runner) -> dict[str, Prompt]:
    """The runner's ``Prompt`` per request id (made once per request: ``request_prompt``; the requests that left
    the batch are dropped by ``forget_departed``)."""
    prompts = getattr(runner, "_cartspec_prompts", None)
    if prompts is None:
        prompts = {}
        runner._cartspec_prompts = prompts
    return prompts


def forget_departed(prompts: dict[str, Prompt], batch) -> None:
    """Drop the ``Prompt`` of every request no longer in ``batch`` (finished or preempted: a preempted one makes
    its own again when it is back)."""
    if len(prompts) > batch.num_reqs:
        live = set(batch.req_ids[:batch.num_reqs])
        for req in [r for r in prompts if r not in live]:
            del prompts[req]


def request_prompt(prompts: dict[str, Prompt], req_id: str, token_row: np.ndarray, prompt_len: int,
                   num_tokens: int) -> Prompt | None:
    """Request ``req_id``'s ``Prompt`` (its first ``prompt_len`` tokens), made from its token row on its first
    step and kept; None while its prompt is not all in the row (a partial prefill)."""
    pr = prompts.get(req_id)
    if pr is None or len(pr) != prompt_len:
        if num_tokens < prompt_len:
            return None
        pr = prompts[req_id] = Prompt(token_row[:prompt_len].tolist())
    return pr


def _first_or_end(draft: Sequence[int], head: Sequence[int], end: int) -> int:
    """The first position where ``draft`` leaves the head's draft (``drafting.length.first_copy``), ``end``
    where one is a prefix of the other."""
    f = first_copy(draft, head)
    return end if f is None else f


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
    bases: dict[int, list[int]] = {}
    prompts = request_prompts(runner)
    for i in range(min(num_reqs, len(rows))):
        if not rows[i]:
            continue
        if padded:
            srow = None if discard[i] else sampled[i]
        else:
            srow = None  # bookkeeping already appended this step's tokens
            if i < len(sampled_token_ids) and not sampled_token_ids[i]:
                continue  # no token this step (partial prefill): nothing is drafted for it
        n, P = int(batch.num_tokens_no_spec[i]), int(batch.num_prompt_tokens[i])
        prompt = request_prompt(prompts, batch.req_ids[i], batch.token_ids_cpu[i], P, n)
        ctx = context_for(batch.token_ids_cpu[i], n, srow, batch.vocab_size, prompt)
        schema = runner_schemas(runner).of(runner, batch.req_ids[i]) if cfg.rule in NEEDS_SCHEMA else None
        if cfg.rule in NEEDS_SCHEMA and schema is None:
            continue  # no schema for this request: the head's draft stands
        new, start = combine(rows[i], ctx, P, cfg, info, pointer, schema=schema, prompt=prompt)
        if new != rows[i]:
            combined[i] = new
            bases[i] = start
    forget_departed(prompts, batch)
    if combined and probs is not None and cfg.head_p > 0:
        # judged where the draft leaves its base (the head's, with a number's or a word's rest: ``rules.base``)
        firsts = {i: f for i, new in combined.items() if (f := first_copy(new, bases[i])) is not None}
        p = probs(sorted(firsts.items()))
        combined = {i: gate(new, bases[i], {firsts[i]: p[(i, firsts[i])]} if (i, firsts[i]) in p else None,
                            cfg.head_p) if i in firsts else new for i, new in combined.items()}
    changed = False
    copies: dict[int, int] = {}  # request -> its first copied position: draft_stop cuts only the head's tokens
    for i, new in combined.items():
        if new != rows[i]:
            copies[i] = _first_or_end(new, rows[i], len(rows[i]))
            rows[i] = new
            changed = True
    runner._cartspec_copies = copies
    if not changed:
        return drafts
    if as_tensor:
        return torch.tensor(rows, dtype=drafts.dtype, device=drafts.device)
    return rows


PATCH = Patch(
    name="hybrid", module=MODULE, what="the hybrid drafter (EAGLE-3 head + prompt copies) in the model runner",
    targets=(Target(MODULE, "GPUModelRunner.propose_draft_token_ids",
                    ("self", "scheduler_output", "sampled_token_ids")),
             Target("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer._greedy_sample",
                    ("self", "hidden_states"))),
    apply=apply, needed=needed)
