"""The schema drafter in vLLM: a ``custom_class`` proposer, and patch ``schema_batch`` that gives it the batch.

vLLM's public interface for a model-free proposer is ``--speculative-config '{"method": "custom_class",
"model": "cartspec.vllm_plugin.schema.SchemaProposer", ...}'``: vLLM 0.32 builds the class with its
``VllmConfig`` and calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``
each step, after the runner's bookkeeping, for the requests' rows (``GPUModelRunner.propose_draft_token_ids``).

What that interface lacks, and the patch supplies: the call carries token rows only. Which request a row is
(``input_batch.req_ids``), where its prompt ends (``input_batch.num_prompt_tokens``) and the JSON schema the
request asked for (its ``sampling_params.structured_outputs``, from OpenAI's ``response_format``) are the
runner's. Without them a proposer can neither keep a request's grammar state between steps nor tell the
reply from the prompt. Patch ``schema_batch`` wraps ``GPUModelRunner.propose_draft_token_ids`` to hand the
runner to the proposer once (``SchemaProposer.bind``); it does nothing in a runner with another proposer.

A request's schema: the one it sent (``response_format`` of type ``json_schema``), else the deployment's
(``--additional-config '{"cartspec_schema": {"schema": {...}}}'``, which ``VllmServer`` sets from the spec's
``speculative.schema``; by default the commerce task's search and support replies). A request whose reply
leaves the grammar (free text) gets no drafts from then on.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, Sequence

from .registry import Patch, Target

MODULE = "vllm.v1.worker.gpu_model_runner"
KEY = "cartspec_schema"  # the deployment's settings in vLLM's additional_config
CLASS_PATH = "cartspec.vllm_plugin.schema.SchemaProposer"
MAX_TRACKS = 4096  # request tracks kept (finished requests' are dropped each step)


class Schemas:
    """Each request's compiled schema in a runner: the one it sent (``response_format``), else the deployment's
    (``additional_config[KEY]``); compiled once per schema, with the served model's tokenizer."""

    def __init__(self, vllm_config: Any):
        from transformers import AutoTokenizer

        extra = getattr(vllm_config, "additional_config", None) or {}
        self.default = (extra.get(KEY) or {}).get("schema")
        mc = vllm_config.model_config
        self.tokenizer = AutoTokenizer.from_pretrained(str(getattr(mc, "tokenizer", None) or mc.model))
        self.compiler = None
        self.grammars: dict[str, Any] = {}
        self._default = None

    def grammar(self, schema: Any):
        """The compiled grammar of ``schema`` (a dict or its JSON), compiled once per schema."""
        from ..drafting.schema import SchemaGrammar

        # never sort_keys: the order of a schema's properties is the order the reply writes them
        text = schema if isinstance(schema, str) else json.dumps(schema)
        g = self.grammars.get(text)
        if g is None:
            if self.compiler is None:
                import xgrammar as xgr

                self.compiler = xgr.GrammarCompiler(
                    xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=len(self.tokenizer)))
            g = self.grammars[text] = SchemaGrammar(self.tokenizer, text, compiler=self.compiler)
        return g

    def of(self, runner: Any, req_id: str):
        """The request's ``SchemaGrammar``: its own schema, else the deployment's; None: neither."""
        state = getattr(runner, "requests", {}).get(req_id)
        so = getattr(getattr(state, "sampling_params", None), "structured_outputs", None)
        if so is not None and getattr(so, "json", None) is not None:
            return self.grammar(so.json)
        if self.default is None:
            return None
        if self._default is None:  # asked per request and step (the hybrid): compiled and keyed once
            self._default = self.grammar(self.default)
        return self._default


def runner_schemas(runner: Any) -> Schemas:
    """The runner's ``Schemas`` (made once per runner): for the hybrid's rule ``schema``."""
    s = getattr(runner, "_cartspec_schemas", None)
    if s is None:
        s = runner._cartspec_schemas = Schemas(runner.vllm_config)
    return s


class SchemaProposer:
    """vLLM ``custom_class`` proposer: each request's draft from its JSON schema and its prompt
    (``drafting.schema``)."""

    def __init__(self, vllm_config: Any):
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.schemas = Schemas(vllm_config)
        self.tokenizer = self.schemas.tokenizer
        self.tracks: dict[str, Any] = {}
        self.runner: Any = None
        print(f"cartspec: schema drafter, γ={self.k}, deployment schema "
              f"{'given' if self.schemas.default else 'none (requests that send one)'}", file=sys.stderr, flush=True)

    def load_model(self, target_model: Any) -> None:
        """Nothing to load (vLLM's CPU runner calls this on every drafter, a custom one included)."""

    def bind(self, runner: Any) -> None:
        self.runner = runner

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        if self.runner is None:
            raise RuntimeError("cartspec's schema drafter has no batch: patch 'schema_batch' did not bind the "
                               "runner (see the 'cartspec patch:' lines of the server log)")
        batch = self.runner.input_batch
        out: list[list[int]] = []
        live = set()
        for i, sampled in enumerate(sampled_token_ids):
            if not len(sampled):
                out.append([])  # no token this step (a partial prefill): nothing to draft after
                continue
            rid = batch.req_ids[i]
            live.add(rid)
            if rid not in self.tracks:
                grammar = self.schemas.of(self.runner, rid)
                P = int(batch.num_prompt_tokens[i])
                self.tracks[rid] = (P, None if grammar is None else grammar.track(token_ids_cpu[i, :P]))
            P, track = self.tracks[rid]
            if track is None:
                out.append([])
                continue
            track.feed(token_ids_cpu[i, P:int(num_tokens_no_spec[i])])
            out.append(track.draft(self.k))
        if len(self.tracks) > len(live) and (len(self.tracks) > MAX_TRACKS or len(self.tracks) > 2 * len(live) + 64):
            self.tracks = {r: t for r, t in self.tracks.items() if r in live}
        return out


def needed() -> str | None:
    return None  # wrapped in every process; it binds only a runner whose proposer is the schema drafter


def apply(mod) -> None:
    """Wrap ``GPUModelRunner.propose_draft_token_ids`` to bind the runner to a ``SchemaProposer`` once."""
    runner = mod.GPUModelRunner
    original = runner.propose_draft_token_ids

    @functools.wraps(original)
    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, SchemaProposer) and drafter.runner is None:
            drafter.bind(self)
        return original(self, *args, **kwargs)

    runner.propose_draft_token_ids = propose_draft_token_ids


PATCH = Patch(
    name="schema_batch", module=MODULE,
    what="gives the schema drafter (a custom_class proposer) the runner's batch: request ids, prompt lengths, "
         "each request's JSON schema",
    targets=(Target(MODULE, "GPUModelRunner.propose_draft_token_ids", ("self", "scheduler_output", "sampled_token_ids")),
             Target("vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids", ()),
             Target("vllm.v1.spec_decode.custom_class_proposer", "create_custom_proposer", ("vllm_config",))),
    apply=apply, needed=needed)
