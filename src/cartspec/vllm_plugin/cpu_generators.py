"""Patch ``cpu_generators``: seeded sampled requests on CPU survive a discarded draw.

A request with a ``seed`` gets its own ``torch.Generator``. When the runner
throws away a token it sampled for a request (a prompt prefilled in chunks
under load), ``GPUModelRunner._bookkeeping_sync`` rewinds that generator with
``gen.set_offset(gen.get_offset() - 4)``: CUDA's Philox has offsets, the CPU
Mersenne Twister does not, and torch raises ``RuntimeError: CPU Generator does
not use offset``. The engine core dies with every request in flight (study
``paper`` preset, c=32, T=0.5, session 3). The fix gives that module a
``torch.Generator`` subclass that saves its state before a sampling step whose
token will be discarded and restores it where CUDA would rewind the offset: the
same draws as the plain generator, and the discarded one is undone, as on a GPU.

"""

from __future__ import annotations

import functools
import types

from .cpu_expand import on_cpu
from .registry import Patch, Target

MODULE = "vllm.v1.worker.gpu_model_runner"


@functools.cache
def offset_tolerant_generator_class():
    """CPU ``torch.Generator`` that can undo a step's draws, though CPU generators have no offsets.

    ``checkpoint()`` saves the state (the patched runner calls it just before a sampling step whose
    token it will discard); ``set_offset`` restores it. vLLM only rewinds to undo the one draw of the
    step it is in, which is what CUDA's ``offset - 4`` does, so seeded replies stay reproducible
    however the prompt was chunked or cached. Only installed on the CPU platform."""
    import torch

    class OffsetTolerantGenerator(torch.Generator):
        _saved = None

        def checkpoint(self) -> None:
            self._saved = self.get_state()

        def get_offset(self) -> int:
            return 0

        def set_offset(self, offset: int):
            if self._saved is not None:
                self.set_state(self._saved)
            return self

    return OffsetTolerantGenerator


class _TorchWithTolerantGenerator(types.ModuleType):
    """Stands in for ``torch`` in one module: the same names, but ``Generator`` is the tolerant one."""

    def __init__(self, torch_module, generator_cls):
        super().__init__("torch")
        self.__dict__["_torch"] = torch_module
        self.__dict__["Generator"] = generator_cls

    def __getattr__(self, name):
        return getattr(self._torch, name)


def apply(mod) -> None:
    """Give the model runner generators that can undo a discarded draw on CPU, and checkpoint the
    ones it will discard before each sampling step."""
    gen_cls = offset_tolerant_generator_class()
    mod.torch = _TorchWithTolerantGenerator(mod.torch, gen_cls)
    runner = mod.GPUModelRunner
    original_sample = runner._sample

    @functools.wraps(original_sample)
    def _sample(self, *args, **kwargs):
        # Only the requests whose token this step throws away get rewound (_bookkeeping_sync);
        # the mask is set when the step's inputs are prepared, before sampling.
        discard = self.discard_request_mask.np
        for i, gen in self.input_batch.generators.items():
            if discard[i] and isinstance(gen, gen_cls):
                gen.checkpoint()
        return original_sample(self, *args, **kwargs)

    runner._sample = _sample


PATCH = Patch(
    name="cpu_generators", module=MODULE,
    what="CPU generators that can undo a discarded draw (seeded sampled requests under chunked prefill)",
    targets=(Target(MODULE, "torch"), Target(MODULE, "GPUModelRunner._sample", ("self", "logits", "spec_decode_metadata")),
             Target(MODULE, "GPUModelRunner._bookkeeping_sync")),
    apply=apply, needed=on_cpu)
