"""The CPU worker's heap frozen after warm-up, as vLLM's other workers freeze theirs.

vLLM 0.32 freezes the garbage collector's view of the startup heap (``vllm.utils.gc_utils.freeze_gc_heap``:
``gc.freeze()`` after a full collection) in the engine core and, after warm-up, in the GPU worker
(``Worker.compile_or_warm_up_model``), so that the collections that serving's allocations set off no
longer walk the model, its modules and the engine's startup objects. ``CPUWorker`` overrides
``compile_or_warm_up_model`` without that call: on CPU the worker process, where the model runner and
every drafter run, keeps all of its startup objects in the oldest generation, and every full collection
during serving walks them, in the middle of whichever step's allocation set it off.

This patch calls ``freeze_gc_heap`` at the end of ``CPUWorker.compile_or_warm_up_model``: what the GPU
worker does at the same point. Nothing the model computes changes; objects allocated before the freeze
are never collected again (as on GPU). The garbage collector's share of each step is in the step counters
(``steps``: ``gc_s``).

Patch ``worker_gc`` of cartspec's vLLM plugin (``vllm_plugin``), in the CPU worker process.
``CARTSPEC_WORKER_GC=vllm`` keeps vLLM's own CPU worker (for A/B runs).
"""

from __future__ import annotations

import functools

from .registry import Patch, Target

MODULE = "vllm.v1.worker.cpu_worker"
ENV = "CARTSPEC_WORKER_GC"
MODES = ("freeze", "vllm")


def mode() -> str:
    """``freeze`` (the default) or ``vllm`` (vLLM's own CPU worker), from ``CARTSPEC_WORKER_GC``."""
    from . import env_mode

    return env_mode(ENV, MODES)


def apply(mod) -> None:
    """Wrap ``CPUWorker.compile_or_warm_up_model`` so that it ends with ``freeze_gc_heap()``."""
    from vllm.utils.gc_utils import freeze_gc_heap

    worker_cls = mod.CPUWorker
    original = worker_cls.compile_or_warm_up_model

    @functools.wraps(original)
    def compile_or_warm_up_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        freeze_gc_heap()
        return out

    worker_cls.compile_or_warm_up_model = compile_or_warm_up_model


def needed() -> str | None:
    return f"{ENV}=vllm" if mode() == "vllm" else None


PATCH = Patch(
    name="worker_gc", module=MODULE,
    what="the CPU worker freezes its startup heap after warm-up, as vLLM's GPU worker and engine core do, so "
         "that garbage collections during serving do not walk the model",
    targets=(Target(MODULE, "CPUWorker.compile_or_warm_up_model", ("self",)),
             Target("vllm.utils.gc_utils", "freeze_gc_heap")),
    apply=apply, needed=needed)
