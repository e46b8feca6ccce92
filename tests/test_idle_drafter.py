"""γ = 0 steps of a schedule skip the EAGLE drafter; every other step runs it unchanged."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from cartspec.vllm_plugin import idle_drafter  # noqa: E402
from cartspec.vllm_plugin.registry import PatchError, run  # noqa: E402


def patch_runner(mod, statuses=None) -> bool:
    """Apply the patch to a stand-in module; True if it was applied now."""
    statuses = {} if statuses is None else statuses
    before = dict(statuses)
    return run(idle_drafter.PATCH, mod, statuses).status == "applied" and "idle_drafter" not in before


class _Cfg:
    def __init__(self, method):
        self.method = method

    def use_eagle(self):
        return self.method in ("eagle", "eagle3")


def _module(method="eagle3", event=None):
    calls = []

    class GPUModelRunner:
        def __init__(self):
            self.speculative_config = _Cfg(method)
            self.valid_sampled_token_count_event = event
            self.input_batch = types.SimpleNamespace(num_reqs=3)
            self.device = torch.device("cpu")

        def propose_draft_token_ids(self, scheduler_output, sampled, *rest):
            calls.append(scheduler_output.num_spec_tokens_to_schedule)
            return torch.ones(3, scheduler_output.num_spec_tokens_to_schedule, dtype=torch.int64)

    return types.SimpleNamespace(GPUModelRunner=GPUModelRunner), calls


def _step(k):
    return types.SimpleNamespace(num_spec_tokens_to_schedule=k)


def test_k0_returns_an_empty_draft_without_calling_the_drafter(monkeypatch):
    monkeypatch.delenv(idle_drafter.ENV, raising=False)
    mod, calls = _module()
    statuses = {}
    assert patch_runner(mod, statuses)
    runner = mod.GPUModelRunner()
    out = runner.propose_draft_token_ids(_step(0), None)
    assert calls == [] and tuple(out.shape) == (3, 0) and out.dtype == torch.int64
    out = runner.propose_draft_token_ids(_step(3), None)
    assert calls == [3] and tuple(out.shape) == (3, 3)
    assert not patch_runner(mod, statuses), "patching twice must not wrap twice"


@pytest.mark.parametrize("method,event", [("ngram", None), ("eagle3", object())])
def test_other_methods_and_async_runners_keep_the_drafter(monkeypatch, method, event):
    monkeypatch.delenv(idle_drafter.ENV, raising=False)
    mod, calls = _module(method, event)
    patch_runner(mod)
    mod.GPUModelRunner().propose_draft_token_ids(_step(0), None)
    assert calls == [0]


def test_the_env_var_keeps_vllms_behaviour_and_rejects_typos(monkeypatch):
    monkeypatch.setenv(idle_drafter.ENV, "run")
    mod, calls = _module()
    assert not patch_runner(mod)
    mod.GPUModelRunner().propose_draft_token_ids(_step(0), None)
    assert calls == [0]
    monkeypatch.setenv(idle_drafter.ENV, "skp")
    with pytest.raises(PatchError, match="CARTSPEC_DRAFTER_AT_K0"):
        patch_runner(_module()[0])
