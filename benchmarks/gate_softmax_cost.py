"""What the hybrid's gate would cost if it took a softmax over the full vocabulary at every draft position.

vLLM's drafter chooses each draft token by an argmax over the target's vocabulary (SmolLM2: 49,152
tokens; an EAGLE-3 head's 8,192 draft logits spread over it, -inf elsewhere). This times that argmax
against argmax + the probability of the argmax (``float()``, ``max - logsumexp``) on bf16 logits, per
position, for 1, 16 and 32 requests, on 2 threads. Run it alone: it is why ``vllm_plugin.hybrid`` keeps the
drafter's hidden states and computes a probability only where the gate needs one (``head_probs``).

    .venv/bin/python benchmarks/gate_softmax_cost.py
"""
import time

import torch

torch.set_num_threads(2)
for b in (1, 16, 32):
    logits = torch.randn(b, 49152).to(torch.bfloat16)

    def argmax():
        return logits.argmax(-1)

    def with_prob():
        ids = logits.argmax(-1)
        lf = logits.float()
        return ids, (lf.max(-1).values - lf.logsumexp(-1)).exp()

    for f in (argmax, with_prob):
        for _ in range(20):
            f()
        t, n = time.perf_counter(), 200
        for _ in range(n):
            f()
        print(f"{b:3d} requests  {f.__name__:10s} {(time.perf_counter() - t) / n * 1e6:8.0f} µs per position")
