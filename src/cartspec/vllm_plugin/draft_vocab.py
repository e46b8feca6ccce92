"""Patch ``draft_vocab``: an EAGLE-3 head's greedy draft tokens taken from its own draft vocabulary, and their
probabilities where a cartspec drafter asks for them.

An EAGLE-3 head scores a draft vocabulary (8,192 tokens for the bundled head) that maps into the target's.
vLLM 0.32's drafter (``SpecDecodeBaseProposer._greedy_sample``) asks the head's ``compute_logits``, which
spreads those logits over the target's whole vocabulary (49,152 for SmolLM2; -inf elsewhere), then takes
the argmax of the spread rows, at every draft position of every request. Where the draft ids map to
strictly increasing target ids (``draft_targets``), the argmax over the draft logits, mapped, is the same
token, ties included. This patch wraps the drafter's ``_greedy_sample`` on the instance (``record_logits``)
to take it so, for every EAGLE-3 deployment: the same drafts, without the spread.

The argmax is taken over the logits converted to float32 (exact from bfloat16): on CPU, torch's argmax
over a bfloat16 row is about three times slower than the conversion and a float32 argmax together
(``benchmarks/draft_argmax_cost.py``), and it runs at every draft position of every step.

At a step where a cartspec drafter needs the head's probability of the tokens it chose (the hybrid's gate,
the draft length per request), it sets ``drafter._cartspec_recording`` before vLLM's drafting runs and
reads, from the list ``record_logits`` returns, each position's float32 logits (``[batch, vocab]``, kept
as computed: nothing more is done while the head drafts); ``probs_of`` turns the rows it needs into the
probability of each row's argmax (a softmax over the draft vocabulary). The flag is reset after each step.
A drafter that picks its tokens another way (``use_local_argmax_reduction``, a heterogeneous vocabulary)
is left as vLLM has it; a head without a draft vocabulary keeps vLLM's logits (probabilities then from
the full ones).
"""

from __future__ import annotations

import functools
import weakref

from .registry import Patch, Target

MODULE = "vllm.v1.worker.gpu_model_runner"
PROPOSER = "vllm.v1.spec_decode.llm_base_proposer"


def needed() -> str | None:
    return None  # every EAGLE-3 runner; a runner with another proposer passes through


def draft_targets(model):
    """The target ids of an EAGLE-3 head's draft vocabulary (``d + draft_id_to_target_id[d]``, vLLM 0.32's
    ``Eagle3LlamaForCausalLM.compute_logits``) where they increase strictly (an argmax over the draft logits
    then picks what vLLM's argmax over the spread logits picks, ties included); None otherwise (the full
    logits are used). Computed once per head, and anew where its mapping changed in place."""
    import torch

    d2t = getattr(model, "draft_id_to_target_id", None)
    if d2t is None or not hasattr(model, "logits_processor") or not hasattr(model, "lm_head"):
        return None
    hit = _TARGETS.get(model)
    if hit is not None and hit[0] is d2t and hit[1] == d2t._version:
        return hit[2]
    targets = torch.arange(d2t.shape[0], device=d2t.device) + d2t
    if targets.numel() > 1 and not bool((targets[1:] > targets[:-1]).all()):
        targets = None
    _TARGETS[model] = (d2t, d2t._version, targets)
    return targets


_TARGETS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def probs_of(logits):
    """Each row's probability of its own argmax (``[..., rows]``), from float logits (``[..., rows, vocab]``,
    -inf allowed): 1 / sum(exp(logits - max)), the softmax at the argmax without the whole softmax."""
    m = logits.max(dim=-1, keepdim=True).values
    return 1.0 / (logits - m).exp().sum(dim=-1)


def record_logits(drafter) -> list | None:
    """Wrap the EAGLE drafter's ``_greedy_sample`` on the instance, once (module doc); the list it appends
    each position's float32 logits to (``[batch, vocab]``; ``probs_of`` gives probabilities) at a step with
    ``_cartspec_recording`` set, emptied by the caller before each step; None for a drafter it leaves alone."""
    if drafter is None or not hasattr(drafter, "_greedy_sample") or not hasattr(drafter, "model"):
        return None
    if getattr(drafter, "use_local_argmax_reduction", False) or getattr(drafter, "use_heterogeneous_vocab", False):
        return None
    kept = getattr(drafter, "_cartspec_logits", None)
    if kept is not None:
        return kept
    kept = []
    original = drafter._greedy_sample

    def _greedy_sample(hidden_states):
        import torch

        recording = getattr(drafter, "_cartspec_recording", False)
        targets = draft_targets(drafter.model)
        if targets is None and not recording:
            return original(hidden_states)  # vLLM's own
        with torch.no_grad():
            if targets is None:  # the model's logits over the target vocabulary, as vLLM takes them
                lf = drafter.model.compute_logits(hidden_states).float()
                kept.append(lf)
                return lf.argmax(dim=-1)  # vLLM's own choice (the float32 logits are exact)
            # the head's logits before vLLM spreads them over the target vocabulary: the same argmax, taken
            # in float32 (module doc), and where asked kept for the probabilities
            lf = drafter.model.logits_processor(drafter.model.lm_head, hidden_states).float()
            if recording:
                kept.append(lf)
            return targets[lf.argmax(dim=-1)]

    drafter._greedy_sample = _greedy_sample
    drafter._cartspec_logits = kept
    return kept


def apply(mod) -> None:
    """Wrap ``GPUModelRunner.propose_draft_token_ids``: in an EAGLE-3 runner, the drafter's ``_greedy_sample``
    is wrapped (``record_logits``) before it first drafts, and the recording flag reset after every step."""
    runner_cls = mod.GPUModelRunner
    original = runner_cls.propose_draft_token_ids

    @functools.wraps(original)
    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if drafter is None or getattr(self.speculative_config, "method", None) != "eagle3":
            return original(self, *args, **kwargs)
        record_logits(drafter)
        try:
            return original(self, *args, **kwargs)
        finally:
            drafter._cartspec_recording = False

    runner_cls.propose_draft_token_ids = propose_draft_token_ids


PATCH = Patch(
    name="draft_vocab", module=MODULE,
    what="an EAGLE-3 head's greedy draft tokens from its draft-vocabulary logits (vLLM's argmax, without "
         "spreading them over the target vocabulary), and their probabilities for cartspec's drafters",
    targets=(Target(MODULE, "GPUModelRunner.propose_draft_token_ids", ("self", "scheduler_output")),
             Target(PROPOSER, "SpecDecodeBaseProposer._greedy_sample", ("self", "hidden_states")),
             # the draft vocabulary's logits before they are spread over the target's (``draft_targets``)
             Target("vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM.compute_logits",
                    ("self", "hidden_states"))),
    apply=apply, needed=needed)
