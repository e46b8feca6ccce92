"""Patch ``draft_stop``: draft length per request and per step, in an EAGLE-3 or hybrid deployment that asks for it.

What it does (the rule: ``drafting.length``): each request's draft is cut where the head's probability of
the path drafted so far falls below the deployment's threshold at this step's batch (``threshold_at``:
whole from ``FULL_BATCH`` requests on, nothing cut at one), so the target verifies only tokens the head is
sure enough of. vLLM 0.32 drafts ``num_speculative_tokens`` for every request (a schedule sets it
per batch size, never per request), and its speculative config takes no such setting; the threshold
travels in vLLM's ``additional_config`` (``{"cartspec_draft_stop": {"p": θ}}``), which ``VllmServer`` sets
for a spec with ``speculative.draft_stop``.

Where it plugs in (vLLM 0.32 as installed):

* the head's probability of each token it drafts comes from patch ``draft_vocab`` (``record_logits``: the
  head's draft-vocabulary logits at the step's positions, with vLLM's own token; ``probs_of``: the softmax
  at that token), which this wrap asks for at a step that cuts. A drafter that picks tokens another way (``use_local_argmax_reduction``,
  a heterogeneous vocabulary) gives none, and nothing is cut;
* ``GPUModelRunner.propose_draft_token_ids`` is wrapped: after vLLM's drafter returns its
  ``[num_reqs, k]`` tensor, each row is cut to its kept length and the drafts go back as lists, which
  vLLM's runner and scheduler take from every proposer (n-gram drafts are lists of any length).
  Verification is vLLM's, on what is left: greedy replies stay the target's.
* in a hybrid deployment patch ``hybrid`` wraps the same method inside this one: the drafts this wrap cuts are
  the combined ones, and the hybrid leaves each request's first copied position on the runner
  (``_cartspec_copies``); the head's probabilities cut only the head's tokens before it
  (``drafting.length.with_copy``).

A runner without the setting drafts as vLLM does. Counts of drafted and kept tokens go to the step
statistics (``vllm_plugin.steps``).
"""

from __future__ import annotations

import functools

from ..drafting.length import FULL_BATCH, KEY, check_stop_p, kept_lengths, threshold_at, with_copy
from .draft_vocab import probs_of, record_logits
from .registry import Patch, Target

MODULE = "vllm.v1.worker.gpu_model_runner"


def needed() -> str | None:
    return None  # wrapped in every process; it cuts drafts only in a runner whose vLLM config asks (``stop_p``)


def stop_p(runner) -> tuple[float, int] | None:
    """This runner's threshold and the batch from which it applies whole (``drafting.length.threshold_at``):
    vLLM's ``additional_config`` under ``KEY``, read once per runner; None where the deployment did not ask
    (drafts pass through)."""
    from .settings import runner_setting

    return runner_setting(
        runner, KEY, lambda v: (check_stop_p(v["p"]), int(v.get("full_batch", FULL_BATCH))),
        lambda s: (f"cartspec: draft length per request in this runner: stop where the draft's path probability "
                   f"< {s[0]} from {s[1]} requests in a step on (less below, nothing cut at one)"))


def cut(drafts, logits: list, p: float, num_reqs: int, copies: dict[int, int] | None = None):
    """``drafts`` (``[num_reqs, k]``) as lists, each cut at its kept length; the drafts unchanged where the
    recorded logits (``draft_vocab.record_logits``, per position) do not cover them (a step drafted otherwise). ``copies``: in a hybrid, each
    request's first copied position (``drafting.length.with_copy``: the head's probabilities judge only the
    head's tokens before it). Returns (drafts, drafted, kept)."""
    import torch

    if not isinstance(drafts, torch.Tensor) or drafts.dim() != 2 or drafts.shape[1] == 0:
        return drafts, 0, 0
    k = drafts.shape[1]
    if len(logits) < k or any(t.shape[0] < num_reqs for t in logits[:k]):
        return drafts, 0, 0
    table = probs_of(torch.stack([t[:num_reqs] for t in logits[:k]], dim=1))  # [num_reqs, k]
    lengths = kept_lengths(table, p)
    if copies:
        lengths = [with_copy(n, copies.get(i), k) for i, n in enumerate(lengths)]
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
        probs = record_logits(drafter) if p > 0 else None
        if probs is None:  # nothing to cut at this batch (or a drafter this cannot read): vLLM's drafts
            return original(self, scheduler_output, *args, **kwargs)
        drafter._cartspec_recording = True
        probs.clear()
        self._cartspec_copies = None
        drafts = original(self, scheduler_output, *args, **kwargs)
        # a hybrid's copies this step (patch hybrid, which runs inside this wrap, sets them)
        out, drafted, kept = cut(drafts, probs, p, num_reqs, self._cartspec_copies)
        if drafted:
            from .steps import count_drafts

            count_drafts(self, drafted, kept)
        return out

    runner_cls.propose_draft_token_ids = propose_draft_token_ids


PATCH = Patch(
    name="draft_stop", module=MODULE,
    what="draft length per request: an EAGLE-3 draft is cut where the head's path probability falls below the "
         "deployment's threshold",
    targets=(Target(MODULE, "GPUModelRunner.propose_draft_token_ids", ("self", "scheduler_output")),),
    apply=apply, needed=needed)
