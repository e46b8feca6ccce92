"""Recovered-token noise on CPU: none drawn without drafts, the right distribution, seeded rows reproducible."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from _cuda import cpu_only, run_like_a_vllm_process

from cartspec.vllm_plugin import recovered_noise
from cartspec.vllm_plugin.registry import run


def test_noise_is_exponential_in_drafted_rows_and_finite_elsewhere():
    torch.manual_seed(0)
    q = recovered_noise.exponential_noise([2, 0, 1], 50_000, {})
    assert q.shape == (3, 50_000) and torch.isfinite(q).all() and (q > 0).all()
    assert torch.all(q[1] == -math.log(0.5))  # no draft: a constant the kernel never reads
    drawn = q[[0, 2]].flatten()
    assert drawn.mean().item() == pytest.approx(1.0, abs=0.01)  # Exp(1): mean 1, P(q > 1) = 1/e
    assert (drawn > 1).float().mean().item() == pytest.approx(math.exp(-1), abs=0.005)


def test_a_seeded_row_draws_from_its_own_generator_only():
    def row0(batch: int) -> torch.Tensor:
        gens = {0: torch.Generator().manual_seed(11)}
        return recovered_noise.exponential_noise([1] * batch, 1000, gens)[0]

    assert torch.equal(row0(1), row0(16))  # other requests in the batch do not move it
    fresh = torch.empty(1000).uniform_(generator=torch.Generator().manual_seed(11))
    assert torch.allclose(row0(4), -fresh.log())


def test_the_env_var_keeps_vllms_function_and_rejects_typos(monkeypatch):
    monkeypatch.setenv(recovered_noise.ENV, "vllm")
    assert recovered_noise.mode() == "vllm"

    class Mod:
        sample_recovered_tokens = staticmethod(lambda *a: None)

    original = Mod.sample_recovered_tokens
    status = run(recovered_noise.PATCH, Mod, {})
    assert (status.status, status.reason) == ("skipped", "CARTSPEC_RECOVERED_NOISE=vllm")
    assert Mod.sample_recovered_tokens is original
    monkeypatch.setenv(recovered_noise.ENV, "sometimes")
    with pytest.raises(ValueError, match="CARTSPEC_RECOVERED_NOISE"):
        recovered_noise.mode()


# Through vLLM's own rejection sampler module and CPU kernel, in an interpreter started the way
# every vLLM process starts (vLLM loads cartspec's plugin, which applies the patch).
_CHECK = """
import types, torch
from vllm.platforms import current_platform
current_platform.import_kernels()
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample import rejection_sampler as rs
print("PATCHED", hasattr(rs.sample_recovered_tokens, "__wrapped__"))
target = torch.tensor([.05, .1, .2, .3, .15, .1, .05, .05])
V = len(target)

def call(num_draft, gens=None, draft_token=3):
    n = len(num_draft)
    cu = torch.tensor(num_draft).cumsum(0)
    total = int(cu[-1])
    return rs.sample_recovered_tokens(1, num_draft, cu, torch.full((total,), draft_token, dtype=torch.int64), None,
                                      target.repeat(total, 1).contiguous(),
                                      types.SimpleNamespace(generators=gens or {}), "cpu", False)

state = torch.get_rng_state()
out = call([0, 0, 0])
print("EMPTY", out.numel(), torch.equal(state, torch.get_rng_state()))
N = 20000
rec = call([1] * N)
print("FREQ", *[round(x, 4) for x in (torch.bincount(rec, minlength=V).float() / N).tolist()])
same = all(int(call([1], {0: torch.Generator().manual_seed(s)})[0])
           == int(call([1] * 16, {0: torch.Generator().manual_seed(s)})[0]) for s in range(40))
print("SEEDED", same)
"""


@cpu_only("the patch replaces the rejection sampler's noise on CPU only")
def test_servers_we_start_sample_recovered_tokens_from_the_right_distribution():
    pytest.importorskip("vllm")
    env = dict(os.environ)
    env.pop(recovered_noise.ENV, None)
    prelude = "from vllm.plugins import load_general_plugins\nload_general_plugins()\n"  # as every vLLM process
    out = subprocess.run([sys.executable, "-c", prelude + _CHECK], env=env, capture_output=True, text=True,
                         timeout=300)
    lines = {x.split()[0]: x.split()[1:] for x in out.stdout.splitlines() if x.split()}
    assert lines.get("PATCHED") == ["True"], out.stderr[-3000:]
    assert lines["EMPTY"] == ["0", "True"]  # nothing drafted: nothing drawn, no generator moved
    # A rejected draft token is replaced from the target's distribution without it (no draft probs: EAGLE).
    expected = [0.05, 0.1, 0.2, 0.0, 0.15, 0.1, 0.05, 0.05]
    expected = [p / sum(expected) for p in expected]
    assert [float(x) for x in lines["FREQ"]] == pytest.approx(expected, abs=0.015)
    assert lines["SEEDED"] == ["True"]  # a seeded request's recovered token does not depend on its batch
    assert "cartspec patch: recovered_noise applied" in out.stderr
