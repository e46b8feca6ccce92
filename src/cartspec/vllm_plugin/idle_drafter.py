"""γ = 0 means no drafter work: skip EAGLE's forward pass at steps a schedule turns speculation off.

vLLM 0.32 runs a ``num_speculative_tokens_per_batch_size`` schedule in the
scheduler: at a batch size whose γ is 0 no token is drafted. The EAGLE drafter
still runs its first forward pass over every scheduled token at those steps
(``llm_base_proposer.propose``: "the prefill forward pass above already ran to
keep the drafter KV cache in sync") and then returns an empty draft. That pass
is the whole cost of a deployment that is not speculating: a schedule with
γ = 0 at high load is then slower than the plain deployment it should match.

With this patch, at a step where the scheduler asks for 0 draft tokens the
runner returns an empty draft without calling the drafter. Verification is
unchanged (nothing is drafted, so nothing is verified): replies stay exactly the
target's. The price: the drafter's KV cache is not written for the tokens of
those steps, so a request that later drafts again (the batch shrank below the
γ = 0 range) drafts over stale entries for them and is accepted less until it
ends; requests that start and end under load never draft at all.

Patch ``idle_drafter`` of cartspec's vLLM plugin (``vllm_plugin``), in every vLLM
process, for EAGLE-family methods only, and only where the runner copies sampled
token counts synchronously (vLLM's CPU runner; with CUDA async scheduling the
drafter's bookkeeping of the next tokens is needed, so the runner is left as
is). ``CARTSPEC_DRAFTER_AT_K0=run`` keeps vLLM's behaviour (for A/B runs).
"""

from __future__ import annotations

import functools

from .registry import Patch, Target

MODULE = "vllm.v1.worker.gpu_model_runner"
ENV = "CARTSPEC_DRAFTER_AT_K0"
MODES = ("skip", "run")


def mode() -> str:
    """``skip`` (the default) or ``run`` (vLLM's own behaviour), from ``CARTSPEC_DRAFTER_AT_K0``."""
    from .settings import env_mode

    return env_mode(ENV, MODES)


def skips(runner, scheduler_output) -> bool:
    """Does this step need no drafter at all? The scheduler asked for 0 draft tokens, the method
    drafts with a model forward (EAGLE family), and the runner keeps no async count to update."""
    cfg = runner.speculative_config
    if cfg is None or getattr(scheduler_output, "num_spec_tokens_to_schedule", None) != 0:
        return False
    if not cfg.use_eagle():
        return False
    return getattr(runner, "valid_sampled_token_count_event", None) is None


def empty_drafts(runner):
    """What EAGLE's ``propose`` returns at γ = 0: an int64 ``[num_reqs, 0]`` tensor."""
    import torch

    return torch.empty(runner.input_batch.num_reqs, 0, dtype=torch.int64, device=runner.device)


def apply(mod) -> None:
    """Wrap ``GPUModelRunner.propose_draft_token_ids`` so γ = 0 steps skip the drafter."""
    runner_cls = mod.GPUModelRunner
    original = runner_cls.propose_draft_token_ids

    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        if skips(self, scheduler_output):
            self._draft_probs = None
            self._draft_prob_req_ids = None
            return empty_drafts(self)
        return original(self, scheduler_output, *args, **kwargs)

    runner_cls.propose_draft_token_ids = propose_draft_token_ids


def needed() -> str | None:
    return f"{ENV}=run" if mode() == "run" else None


PATCH = Patch(
    name="idle_drafter", module=MODULE, what="steps a schedule gives γ = 0 skip the EAGLE drafter's forward pass",
    targets=(Target(MODULE, "GPUModelRunner.propose_draft_token_ids", ("self", "scheduler_output")),),
    apply=apply, needed=needed)
