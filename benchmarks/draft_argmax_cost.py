"""What choosing a draft token costs on CPU, per draft position: argmax over bfloat16 logits or over float32.

An EAGLE-3 head drafts each token by an argmax over its draft vocabulary (8,192 logits for the bundled
heads; ``vllm_plugin.draft_vocab`` takes it there rather than over the target's 49,152). This times, on
bfloat16 logits ``[batch, 8192]`` for 1, 8 and 32 requests:

* ``bf16_argmax``: ``logits.argmax(-1)``, as vLLM takes it;
* ``f32_argmax``: ``logits.float().argmax(-1)``, as ``draft_vocab`` takes it (the conversion is exact, so
  the token is the same, ties included: checked here on every batch);
* ``old_record``: what the gate's recording used to add at a step it reads (bf16 argmax, then float,
  gather and logsumexp for the probability of the token);
* ``probs_of``: what it does now, on the kept float32 logits: ``1 / sum(exp(l - max))``.

Measured 2026-12-05 (2-core AMD EPYC, AVX-512 with avx512_bf16, torch 2.13.0, Intel OpenMP and tcmalloc
preloaded as cartspec's engine runs vLLM, 2 threads), µs per position at 1 / 8 / 32 requests:
bf16_argmax 30.7 / 119.7 / 470.4, f32_argmax 10.4 / 35.3 / 127.9, old_record 57 / 183 / 656, probs_of
(after f32_argmax) 29.9 / 85.1 / 277. Run it alone, as the engine runs (the preload changes the figures):

    LD_PRELOAD="$(.venv/bin/python -c 'from cartspec.serving.engine import cpu_preload; print(cpu_preload().value)')" \
        .venv/bin/python benchmarks/draft_argmax_cost.py
"""
import time

import torch

from cartspec.vllm_plugin import draft_vocab

torch.set_num_threads(2)
VOCAB = 8192


def timed(f, n=300) -> float:
    for _ in range(20):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    g = torch.Generator().manual_seed(0)
    for b in (1, 8, 32):
        logits = (torch.randn(b, VOCAB, generator=g) * 4).to(torch.bfloat16)  # bf16 rounding makes ties
        lf = logits.float()
        assert torch.equal(logits.argmax(-1), lf.argmax(-1))  # the same token, first of ties in both

        def bf16_argmax():
            return logits.argmax(-1)

        def f32_argmax():
            return logits.float().argmax(-1)

        def old_record():
            ids = logits.argmax(-1)
            x = logits.float()
            return ids, (x.gather(-1, ids[:, None])[:, 0] - x.logsumexp(-1)).exp()

        def probs_of():
            return draft_vocab.probs_of(lf)

        old_p = old_record()[1]
        assert torch.allclose(old_p, probs_of(), atol=1e-6)
        print(f"{b:3d} requests  " + "  ".join(f"{f.__name__} {timed(f):7.1f}" for f in
                                              (bf16_argmax, f32_argmax, old_record, probs_of)) + "  µs per position")


if __name__ == "__main__":
    main()
