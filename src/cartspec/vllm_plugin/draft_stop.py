"""Patch ``draft_stop``: draft length per request and per step, in an EAGLE-3 deployment that asks for it.

What it does (the rule: ``drafting.length``): each request's draft is cut where the head's probability of
the path drafted so far falls below the deployment's threshold at this step's batch (``threshold_at``:
whole from ``FULL_BATCH`` requests on, nothing cut at one), so the target verifies only tokens the head is
sure enough of. vLLM 0.32 drafts ``num_speculative_tokens`` for every request (a schedule sets it
per batch size, never per request), and its speculative config takes no such setting; the threshold
travels in vLLM's ``additional_config`` (``{"cartspec_draft_stop": {"p": θ}}``), which ``VllmServer`` sets
for a spec with ``speculative.draft_stop``.

Where it plugs in (vLLM 0.32 as installed):

* the drafter's ``SpecDecodeBaseProposer._greedy_sample`` (vLLM's one place where each greedy draft token
  is chosen) is wrapped on the instance: at a step that cuts, it takes the head's logits over its draft
  vocabulary (``draft_targets``; the full logits where the head has none), the argmax vLLM takes, and the
  softmax probability of that token (``[batch]`` per position); elsewhere it is vLLM's own.
  A drafter that picks tokens another way (``use_local_argmax_reduction``, a heterogeneous vocabulary)
  is left as it is, and nothing is cut;
* ``GPUModelRunner.propose_draft_token_ids`` is wrapped: after vLLM's drafter returns its
  ``[num_reqs, k]`` tensor, each row is cut to its kept length and the drafts go back as lists, which
  vLLM's runner and scheduler take from every proposer (n-gram drafts are lists of any length).
  Verification is vLLM's, on what is left: greedy replies stay the target's.

A runner without the setting drafts as vLLM does. Counts of drafted and kept tokens go to the step
statistics (``vllm_plugin.steps``).
"""

from __future__ import annotations

import functools

from ..drafting.length import FULL_BATCH, KEY, check_stop_p, kept_lengths, threshold_at
from .registry import Patch, Target

MODULE = "vllm.v1.worker.gpu_model_runner"


def needed() -> str | None:
    return None  # wrapped in every process; it cuts drafts only in a runner whose vLLM config asks (``stop_p``)


def stop_p(runner) -> tuple[float, int] | None:
    """This runner's threshold and the batch from which it applies whole (``drafting.length.threshold_at``):
    vLLM's ``additional_config`` under ``KEY``, read once per runner; None where the deployment did not ask
    (drafts pass through)."""
    from . import runner_setting

    return runner_setting(
        runner, KEY, lambda v: (check_stop_p(v["p"]), int(v.get("full_batch", FULL_BATCH))),
        lambda s: (f"cartspec: draft length per request in this runner: stop where the draft's path probability "
                   f"< {s[0]} from {s[1]} requests in a step on (less below, nothing cut at one)"))


def record_probs(drafter) -> list | None:
    """Make the EAGLE drafter keep, per greedy draft position, its probability of the token it chose
    (``[batch]`` float tensors); the list it appends to, emptied by the caller before each step; None for a
    drafter that chooses its tokens another way (module doc)."""
    if drafter is None or not hasattr(drafter, "_greedy_sample") or not hasattr(drafter, "model"):
        return None
    if getattr(drafter, "use_local_argmax_reduction", False) or getattr(drafter, "use_heterogeneous_vocab", False):
        return None
    probs = getattr(drafter, "_cartspec_probs", None)
    if probs is not None:
        return probs
    probs = []
    targets = draft_targets(drafter.model)
    original = drafter._greedy_sample

    def _greedy_sample(hidden_states):
        import torch

        if not getattr(drafter, "_cartspec_recording", True):  # a step that cuts nothing: vLLM's own
            return original(hidden_states)
        with torch.no_grad():
            if targets is None:  # the model's logits over the target vocabulary, as vLLM takes them
                logits = drafter.model.compute_logits(hidden_states)
                ids = logits.argmax(dim=-1)  # vLLM's own choice
                lf = logits.float()
                probs.append((lf.gather(-1, ids[:, None])[:, 0] - lf.logsumexp(dim=-1)).exp())
                return ids
            # an EAGLE-3 head with a draft vocabulary: its logits before vLLM spreads them over the target
            # vocabulary (-inf elsewhere); the same argmax (draft ids map to increasing target ids), and the
            # softmax over the draft vocabulary, a sixth of the work
            dl = drafter.model.logits_processor(drafter.model.lm_head, hidden_states)
            j = dl.argmax(dim=-1)
            lf = dl.float()
            probs.append((lf.gather(-1, j[:, None])[:, 0] - lf.logsumexp(dim=-1)).exp())
            return targets[j]

    drafter._greedy_sample = _greedy_sample
    drafter._cartspec_probs = probs
    return probs


def draft_targets(model):
    """The target ids of an EAGLE-3 head's draft vocabulary (``d + draft_id_to_target_id[d]``, vLLM 0.32's
    ``Eagle3LlamaForCausalLM.compute_logits``) where they increase strictly (an argmax over the draft logits
    then picks what vLLM's argmax over the spread logits picks, ties included); None otherwise (the full
    logits are used)."""
    import torch

    d2t = getattr(model, "draft_id_to_target_id", None)
    if d2t is None or not hasattr(model, "logits_processor") or not hasattr(model, "lm_head"):
        return None
    targets = torch.arange(d2t.shape[0], device=d2t.device) + d2t
    if targets.numel() > 1 and not bool((targets[1:] > targets[:-1]).all()):
        return None
    return targets


def cut(drafts, probs: list, p: float, num_reqs: int):
    """``drafts`` (``[num_reqs, k]``) as lists, each cut at its kept length; the drafts unchanged where the
    recorded probabilities do not cover them (a step drafted otherwise). Returns (drafts, drafted, kept)."""
    import torch

    if not isinstance(drafts, torch.Tensor) or drafts.dim() != 2 or drafts.shape[1] == 0:
        return drafts, 0, 0
    k = drafts.shape[1]
    if len(probs) < k or any(t.shape[0] < num_reqs for t in probs[:k]):
        return drafts, 0, 0
    table = torch.stack([t[:num_reqs] for t in probs[:k]], dim=1)  # [num_reqs, k]
    lengths = kept_lengths(table, p)
    rows = drafts[:num_reqs].tolist()
    out = [row[:n] for row, n in zip(rows, lengths)]
    return out, k * len(rows), sum(lengths)


def apply(mod) -> None:
    """Wrap ``GPUModelRunner.propose_draft_token_ids`` (module doc)."""
    runner_cls = mod.GPUModelRunner
    original = runner_cls.propose_draft_token_ids

    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        setting = stop_p(self)
        if setting is None or getattr(self.speculative_config, "method", None) != "eagle3":
            return original(self, scheduler_output, *args, **kwargs)
        num_reqs = self.input_batch.num_reqs
        p = threshold_at(setting[0], num_reqs, setting[1])
        drafter = getattr(self, "drafter", None)
        probs = record_probs(drafter) if p > 0 else None
        if probs is None:  # nothing to cut at this batch (or a drafter this cannot read): vLLM's drafts
            if drafter is not None and hasattr(drafter, "_cartspec_probs"):
                drafter._cartspec_recording = False
            return original(self, scheduler_output, *args, **kwargs)
        drafter._cartspec_recording = True
        probs.clear()
        drafts = original(self, scheduler_output, *args, **kwargs)
        out, drafted, kept = cut(drafts, probs, p, num_reqs)
        if drafted:
            from .steps import count_drafts

            count_drafts(self, drafted, kept)
        return out

    runner_cls.propose_draft_token_ids = propose_draft_token_ids


PATCH = Patch(
    name="draft_stop", module=MODULE,
    what="draft length per request: an EAGLE-3 draft is cut where the head's path probability falls below the "
         "deployment's threshold",
    targets=(Target(MODULE, "GPUModelRunner.propose_draft_token_ids", ("self", "scheduler_output")),
             Target("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer._greedy_sample",
                    ("self", "hidden_states")),
             # the draft vocabulary's logits before they are spread over the target's (``draft_targets``)
             Target("vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM.compute_logits",
                    ("self", "hidden_states"))),
    apply=apply, needed=needed)
