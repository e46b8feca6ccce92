"""Patch ``worker_gc``: vLLM's CPU worker freezes its startup heap after warm-up, as its GPU worker does."""

from __future__ import annotations

import gc
import types

import pytest

from cartspec.vllm_plugin import patches, worker_gc
from cartspec.vllm_plugin.registry import run


def _module():
    calls = []

    class CPUWorker:
        def compile_or_warm_up_model(self):
            calls.append(gc.get_freeze_count())
            return "times"

    return types.SimpleNamespace(CPUWorker=CPUWorker), calls


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_worker_freezes_its_heap_once_warm_up_is_done(monkeypatch, unfrozen):
    pytest.importorskip("vllm")
    monkeypatch.delenv(worker_gc.ENV, raising=False)
    mod, calls = _module()
    assert run(worker_gc.PATCH, mod, {}).status == "applied"
    kept = object.__new__(type("Startup", (), {}))  # an object of the startup heap, tracked by the collector
    assert gc.is_tracked(kept) and gc.get_freeze_count() == 0
    assert mod.CPUWorker().compile_or_warm_up_model() == "times"  # what vLLM's method returns, unchanged
    assert calls == [0]  # warm-up ran before the freeze
    assert gc.get_freeze_count() > 0  # the startup heap is out of the collector's walks


def test_an_ab_run_keeps_vllms_own_worker(monkeypatch, unfrozen):
    monkeypatch.setenv(worker_gc.ENV, "vllm")
    mod, _ = _module()
    status = run(worker_gc.PATCH, mod, {})
    assert status.status == "skipped" and "CARTSPEC_WORKER_GC=vllm" in status.reason
    mod.CPUWorker().compile_or_warm_up_model()
    assert gc.get_freeze_count() == 0
    monkeypatch.setenv(worker_gc.ENV, "frozen")
    with pytest.raises(ValueError, match="CARTSPEC_WORKER_GC must be one of"):
        worker_gc.mode()


def test_it_is_registered_before_the_drafting_patches():
    names = [p.name for p in patches()]
    assert names.index("worker_gc") < names.index("draft_vocab")
