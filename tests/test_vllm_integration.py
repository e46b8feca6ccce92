"""Real vLLM on CPU: a model directory exported by us loads and generates."""

import asyncio
import os

import pytest

from cartspec.machine import has_cuda
from cartspec.serving.client import ChatClient
from cartspec.serving.server import VllmServer
from cartspec.serving.spec import DeploymentSpec

pytestmark = pytest.mark.vllm


def test_vllm_serves_an_exported_tiny_model(tiny_llama_dir, tmp_path, monkeypatch):
    from cartspec.quality.structured import evaluate_model

    spec = DeploymentSpec(name="tiny", model=str(tiny_llama_dir), enforce_eager=True, max_model_len=512,
                          max_num_seqs=4)
    with VllmServer(spec, log_dir=tmp_path) as srv:
        async def ask():
            async with ChatClient(srv.url, "tiny", api_key=srv.api_key) as c:
                return await c.chat([{"role": "user", "content": "red shoes"}], max_tokens=8)

        out = asyncio.run(ask())
        assert out.output_tokens > 0 and isinstance(out.text, str)
        # eval-model's path against this running server: random weights, so JSON is invalid,
        # but every request is answered and scored.
        monkeypatch.setenv("CARTSPEC_TEST_VLLM_KEY", srv.api_key)  # the server requires its own random key
        summary = evaluate_model(data=_tiny_file(tmp_path), out=tmp_path / "eval.json", server=srv.url,
                                 served_name="tiny", max_tokens=8, concurrency=4, api_key_env="CARTSPEC_TEST_VLLM_KEY")
        assert summary["n"] == 4 and summary["n_request_errors"] == 0
        assert summary["json_valid"] == 0.0 and summary["exact_match"] == 0.0
    assert not srv.alive()
    # Intel OpenMP and tcmalloc, where installed, reach vLLM's worker: it warns about each one missing
    from cartspec.serving.engine import cpu_preload

    log = srv.log_path.read_text()
    if not has_cuda() and "LD_PRELOAD" not in os.environ:
        for lib in ("libtcmalloc", "libiomp"):
            found = any(lib in x for x in cpu_preload().libraries)
            assert (f"{lib} is not found in LD_PRELOAD" not in log) == found, lib


def _tiny_file(tmp_path):
    from cartspec.task.data import write_requests
    from cartspec.task.generator import generate

    return str(write_requests(tmp_path / "four.jsonl", generate("dev", 4)))


def test_seeded_sampling_survives_a_chunked_prefill(tiny_llama_dir, tmp_path):
    """vLLM rewinds a seeded request's generator when it throws away the token it sampled for a
    partly prefilled prompt. On CPU that raised and killed the engine (``vllm_plugin/cpu_generators.py``); a
    64-token batch budget chunks this ~200-token prompt on every request."""
    spec = DeploymentSpec(name="tiny", model=str(tiny_llama_dir), enforce_eager=True, max_model_len=512,
                          max_num_seqs=4, engine_args=["--max-num-batched-tokens", "64"])
    prompt = [{"role": "user", "content": "red running shoes in size 10 under 50 dollars please " * 20}]
    with VllmServer(spec, log_dir=tmp_path) as srv:
        async def ask(seed):
            async with ChatClient(srv.url, "tiny", api_key=srv.api_key) as c:
                return await c.chat(prompt, max_tokens=8, temperature=1.0, seed=seed)

        first, again = asyncio.run(ask(5)), asyncio.run(ask(5))
        assert srv.alive(), srv.log_path.read_text()[-3000:]
        assert first.output_tokens > 0
        # The second prompt is served from the prefix cache in fewer chunks, so fewer draws are
        # discarded: the same reply only if each discarded draw was undone, as on a GPU.
        assert first.text == again.text
