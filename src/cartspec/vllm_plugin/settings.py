"""A patch's switches (re-exported by ``vllm_plugin``): one from the environment (``env_mode``, for a patch a
user can turn off) and one from the deployment (``runner_setting``: what ``VllmServer`` wrote into vLLM's
``additional_config`` for this runner). The patches' modules import these from here; the package's
``__init__`` imports the patches.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable


def env_mode(name: str, modes: tuple[str, ...]) -> str:
    """A patch's switch from the environment: ``modes[0]`` (the patch) when unset, else one of ``modes``."""
    value = os.environ.get(name, modes[0]).strip().lower() or modes[0]
    if value not in modes:
        raise ValueError(f"{name} must be one of {modes}, got {value!r}")
    return value


def runner_setting(runner, key: str, parse: Callable[[Any], Any], say: Callable[[Any], str] | None = None) -> Any:
    """What this runner's deployment set under ``key`` in vLLM's ``additional_config`` (the settings vLLM keeps
    for plugins; ``VllmServer`` writes them), ``parse``d, read once per runner and kept on it; None where it
    set nothing (the patch then leaves vLLM as it is). ``say(value)``: a line for the server's log."""
    kept = runner.__dict__.setdefault("_cartspec_settings", {})
    if key not in kept:
        extra = getattr(getattr(runner, "vllm_config", None), "additional_config", None) or {}
        raw = extra.get(key) if isinstance(extra, dict) else None
        kept[key] = parse(raw) if raw else None
        if kept[key] is not None and say is not None:
            print(say(kept[key]), file=sys.stderr, flush=True)
    return kept[key]
