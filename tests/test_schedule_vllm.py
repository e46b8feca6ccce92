"""Real vLLM on CPU honours a γ-per-batch-size schedule: what `cartspec tune` writes is what runs.

With ``[[1, 1, 3], [2, 64, 0]]`` a request alone in the batch is drafted for (3 tokens a step), and
requests that share the batch are not. Per-request speculative metrics say how many tokens were
drafted at each verify step of each request.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import make_random_head

pytestmark = pytest.mark.vllm


@pytest.mark.timeout(600)
def test_a_lone_request_drafts_and_a_full_batch_does_not(tiny_llama_dir, tmp_path):
    from cartspec.serving.client import ChatClient
    from cartspec.serving.server import VllmServer
    from cartspec.serving.spec import DeploymentSpec, Speculative

    head = make_random_head(tiny_llama_dir, tmp_path / "head")
    spec = DeploymentSpec(name="tiny", model=str(tiny_llama_dir), enforce_eager=True, max_model_len=512,
                          max_num_seqs=8, speculative=Speculative(method="eagle3", model=str(head),
                                                                  num_speculative_tokens=3,
                                                                  schedule=[(1, 1, 3), (2, 64, 0)]))
    assert spec.speculative.vllm_config(str(head))["num_speculative_tokens_per_batch_size"] == [[1, 1, 3],
                                                                                                [2, 64, 0]]
    prompt = [{"role": "user", "content": "red running shoes in size 10 under 50 dollars"}]
    # ignore_eos: a random model may stop at once; every request must run its full length
    extra = {"ignore_eos": True}

    with VllmServer(spec, log_dir=tmp_path) as srv:
        async def run():
            async with ChatClient(srv.url, "tiny", api_key=srv.api_key) as c:
                lone = await c.chat(prompt, max_tokens=24, extra=extra)
                batch = await asyncio.gather(*(c.chat(prompt, max_tokens=24, extra=extra) for _ in range(6)))
                return lone, batch

        lone, batch = asyncio.run(run())
    drafted_lone = lone.request_spec_metrics["per_step_drafted"]
    assert drafted_lone and all(d == 3 for d in drafted_lone), lone.request_spec_metrics
    # Six requests sent together share the batch (batch size >= 2 -> γ = 0) once all have been admitted;
    # only a request that ran alone for a step (before the others arrived) may have drafted.
    # (a request that never drafted reports per_step_drafted as null)
    drafted = [d for b in batch for d in ((b.request_spec_metrics or {}).get("per_step_drafted") or [])]
    tokens = sum(b.output_tokens for b in batch)
    assert tokens == 6 * 24
    assert sum(drafted) <= 0.1 * 3 * tokens, (sum(drafted), tokens)
    # γ = 0 steps skip the drafter's forward pass (vllm_plugin/idle_drafter.py), and that loses nothing: greedy replies
    # drafted for at every step and replies never drafted for are the target's, token for token.
    log = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
    assert "cartspec patch: idle_drafter applied" in log
    assert all(b.text == lone.text for b in batch), [b.text for b in batch]
