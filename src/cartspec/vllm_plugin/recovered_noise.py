"""Sampled speculative decoding on CPU: recovered-token noise only where a draft was made, drawn cheaper.

At T > 0 vLLM 0.32 verifies drafts by rejection sampling. For the token that
replaces a rejected draft ("recovered" token) ``sample_recovered_tokens`` draws
exponential noise over the whole vocabulary for every request of the batch
(``q.exponential_()`` on a ``[batch, vocab]`` tensor), then draws it again with
the request's own generator for every seeded request with drafts. Two costs
follow on a CPU:

* a speculative deployment runs the rejection sampler at every step, also when
  nothing was drafted (every row then has zero drafts, as at a schedule's γ = 0):
  the noise is drawn and never read;
* with drafts, a batch of 32 seeded requests pays that twice per step.

Both costs, measured side by side with vLLM's function and this one (``benchmarks/sampled_noise_ab.py``),
with the machine that ran it: docs/machine-notes.md, "vLLM on CPU: what cartspec works around".

``patch_module`` replaces ``sample_recovered_tokens`` in
``vllm.v1.sample.rejection_sampler`` (CPU only, not with fp64 Gumbel noise):
with no draft in the batch it returns at once without touching any random
generator; otherwise it draws uniform noise only for the rows that have drafts
(the request's own generator for a seeded request, the global one otherwise,
once each) and turns it into exponential noise by ``-log(u)``, which is the same
distribution (``u`` clamped away from 0). Rows without drafts are never read by
the kernel. Verification is unchanged, so T = 0 is untouched (greedy requests
never reach this function) and T > 0 replies keep their distribution; a seeded
request stays reproducible, but its draws are not vLLM's own, so its sampled
reply differs from what stock vLLM gives for the same seed.

Patch ``recovered_noise`` of cartspec's vLLM plugin (``vllm_plugin``), in every vLLM process.
``CARTSPEC_RECOVERED_NOISE=vllm`` keeps vLLM's own function (for A/B runs).
"""

from __future__ import annotations

import functools

from .registry import Patch, Target

MODULE = "vllm.v1.sample.rejection_sampler"
ENV = "CARTSPEC_RECOVERED_NOISE"
MODES = ("drafted", "vllm")


def mode() -> str:
    """``drafted`` (the default: noise for drafted rows only) or ``vllm`` (vLLM's own), from the environment."""
    from .settings import env_mode

    return env_mode(ENV, MODES)


def exponential_noise(num_draft_tokens, vocab_size: int, generators: dict, dtype=None):
    """``[batch, vocab]`` Exp(1) noise for the rows with drafts (1.0 in the others: never read),
    from ``u`` ~ U(0, 1): ``-log(u)``. A seeded row draws from its own generator only."""
    import torch

    dtype = dtype or torch.float32
    batch = len(num_draft_tokens)
    q = torch.empty((batch, vocab_size), dtype=dtype)
    with_drafts = [i for i, n in enumerate(num_draft_tokens) if n > 0]
    unseeded = [i for i in with_drafts if i not in generators]
    if len(unseeded) == batch:
        q.uniform_()
    else:
        q.fill_(0.5)  # -log(0.5) in rows without drafts: finite, never read
        if unseeded:
            q[unseeded] = torch.rand((len(unseeded), vocab_size), dtype=dtype)
        for i in with_drafts:
            if i in generators:
                q[i].uniform_(generator=generators[i])
    return q.clamp_(min=torch.finfo(dtype).tiny).log_().neg_()


def apply(mod) -> None:
    """Swap ``sample_recovered_tokens`` for the CPU version above."""
    import torch  # imported once here, not on every verify step

    original = mod.sample_recovered_tokens

    @functools.wraps(original)
    def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
                                draft_probs, target_probs, sampling_metadata, device, use_fp64_gumbel=False):
        if use_fp64_gumbel or torch.device(device).type != "cpu":
            return original(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                            target_probs, sampling_metadata, device, use_fp64_gumbel)
        recovered = torch.empty_like(draft_token_ids)
        if not any(n > 0 for n in num_draft_tokens):
            return recovered
        q = exponential_noise(num_draft_tokens, target_probs.shape[-1], sampling_metadata.generators)
        mod._sample_recovered_tokens(recovered, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                                     q.reciprocal_(), max_spec_len=max_spec_len)
        return recovered

    mod.sample_recovered_tokens = sample_recovered_tokens


def needed() -> str | None:
    return f"{ENV}=vllm" if mode() == "vllm" else None


PATCH = Patch(
    name="recovered_noise", module=MODULE,
    what="recovered-token noise drawn only for rows with drafts, on CPU",
    targets=(Target(MODULE, "sample_recovered_tokens",
                    ("max_spec_len", "num_draft_tokens", "cu_num_draft_tokens", "draft_token_ids", "draft_probs",
                     "target_probs", "sampling_metadata", "device", "use_fp64_gumbel")),
             Target(MODULE, "_sample_recovered_tokens")),
    apply=apply, needed=needed)
