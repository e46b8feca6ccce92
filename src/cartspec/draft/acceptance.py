"""Acceptance of a speculative method, measured in vLLM or simulated offline.

``measure_vllm``: one deployment (the target + ``eagle3`` head or ``ngram``),
started here or already running (``server``), every request at temperature 0
with ``--per-request-spec-decode-metrics detailed`` and ``return_token_ids``;
τ and the acceptance rate come from the per-request ``per_step_accepted`` /
``per_step_drafted`` counts, by-class from aligning those steps to the output
tokens (``simulate.steps_from_vllm``).

``measure_simulated``: the same figures from the target's greedy outputs
(``simulate``), without a server.

Both return ``{"tau", "acceptance_rate", "per_position", "by_class", ...}`` plus
run metadata; ``cartspec draft acceptance`` writes it as an ``AcceptanceReport``
(``results_acceptance``), which loads back.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..results import AcceptanceStats
from ..results_acceptance import AcceptanceReport, ClassCount, EngineCounts, ReplySteps  # noqa: F401 (re-exported)
from ..task.data import Request, read_requests

SPLIT_SIZES = {"train": 2400, "dev": 200, "test": 400}  # `cartspec data` defaults
NOVEL_SIZE = 100  # `novel`: held-out-style requests with words in no generator pool (task/novel.py)


def load_data(data: str, limit: int | None = None, seed: int = 0) -> list[Request]:
    """``train|dev|test`` (generated, seed 0, the sizes ``cartspec data`` writes), ``novel`` (words the
    model never saw, ``task.novel``), ``handwritten`` (``task.request_sets.HANDWRITTEN``), ``real`` or
    ``real-traffic`` (real shoppers' queries, ``task.request_sets.REAL``) or a JSONL file."""
    from ..task.request_sets import HANDWRITTEN, REAL_SETS, real_requests

    if data == "handwritten":
        reqs = read_requests(HANDWRITTEN)
    elif data in REAL_SETS:
        reqs = real_requests(data)
    elif data == "novel":
        from ..task.novel import novel_requests

        reqs = novel_requests(max(limit or 0, NOVEL_SIZE), seed)
    elif data in SPLIT_SIZES:
        from ..task.generator import generate

        reqs = generate(data, SPLIT_SIZES[data], seed)  # type: ignore[arg-type]
    else:
        reqs = read_requests(data)
    return reqs[:limit] if limit else reqs


def classes_for(tokenizer, reqs: Sequence[Request], outputs: Sequence[Sequence[int]]) -> list[list[str]]:
    from ..task.classes import request_text, token_classes

    return [token_classes(tokenizer, out, request_text(r)) for r, out in zip(reqs, outputs)]


def _count_classes(classes: Sequence[Sequence[str]]) -> dict[str, int]:
    from collections import Counter

    c = Counter(x for cl in classes for x in cl)
    return dict(c)


def measure_vllm(target: str, method: str, gamma: int, reqs: Sequence[Request], head: str | None = None,
                 concurrency: int = 8, max_tokens: int = 192, log_dir: str | Path = "runs/logs",
                 log: Callable[[str], None] = print, enforce_eager: bool = False,
                 on_done: Callable[[int, int], None] | None = None, dtype: str = "auto",
                 hybrid: Any = None, server: str | None = None, served_name: str | None = None,
                 api_key: str | None = None, reply_schema: str | None = None,
                 draft_stop: float | None = None) -> dict[str, Any]:
    """``method``: eagle3 | ngram | schema | hybrid (``schema``: the schema drafter, over ``reply_schema``'s file
    or the commerce task's replies; ``hybrid``: a ``drafting.config.HybridConfig``; None: the default for the target, as ``serve`` deploys).

    ``server``: measure this running vLLM instead of starting one (``served_name``: its model, default the
    first it lists; ``api_key``: sent as a bearer token). It must run ``target`` with the method, γ and head
    given here, which describe it in the results, and ``--per-request-spec-decode-metrics detailed``; a
    server whose replies carry no token ids is refused (``EndpointError``)."""
    from transformers import AutoTokenizer

    from ..model.heads import version_of
    from ..model.registry import resolve_head, resolve_model
    from ..serving.client import ChatClient, gather_limited
    from ..serving.endpoint import EndpointError, endpoint
    from ..serving.spec import DeploymentSpec, Speculative
    from ..task.prompts import messages
    from .simulate import steps_from_vllm, summarize

    model_dir = resolve_model(target)
    head_dir = resolve_head(head) if method in ("eagle3", "hybrid") else None
    sp = Speculative(method=method, num_speculative_tokens=gamma,
                     model=str(head_dir) if head_dir else None, **_hybrid_fields(method, hybrid),
                     **({"draft_stop": draft_stop} if draft_stop is not None else {}),
                     **({"reply_schema": reply_schema} if reply_schema else {}))
    spec = DeploymentSpec(name="cartspec", model=str(model_dir), speculative=sp, enforce_eager=enforce_eager,
                          max_num_seqs=max(concurrency, 1), dtype=dtype).resolved()
    tok = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.perf_counter()
    # the spec names the resolved directories, so a started server runs exactly these
    with endpoint(server or spec, log_dir=log_dir, api_key=api_key, served_name=served_name,
                  runs=spec if server else None) as ep:
        if server:
            log(f"measuring {ep.url} ({ep.served_name}) as {sp.label} on {model_dir.name}")
        else:
            log(f"vLLM up in {time.perf_counter() - t0:.0f}s: {sp.label} on {model_dir.name}")

        async def run() -> list[Any]:
            async with ChatClient(ep.url, ep.served_name, timeout=600, api_key=ep.api_key) as client:
                done = [0]

                def tick(i, res):
                    done[0] += 1
                    if on_done:
                        on_done(done[0], len(reqs))

                return await gather_limited(
                    (client.chat(messages(r), max_tokens=max_tokens, temperature=0.0,
                                 extra={"return_token_ids": True}) for r in reqs), concurrency, tick)

        t1 = time.perf_counter()
        results = asyncio.run(run())
        wall = time.perf_counter() - t1
        versions = ep.versions
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise requests_failed(ep, len(errors), len(reqs), errors[0])
    outputs = []
    steps = []
    for c in results:
        ch = c.raw["choices"][0]
        ids = ch.get("token_ids") or []
        if server and not ids:
            raise EndpointError(f"{ep.url} returned no token ids (vLLM's return_token_ids): acceptance cannot "
                                "be placed on the reply's tokens")
        outputs.append(ids)
    classes = classes_for(tok, reqs, outputs)
    missing = 0
    for c, cl in zip(results, classes):
        s = c.request_spec_metrics or {}
        if "per_step_accepted" not in s and s.get("num_spec_steps", 0):
            missing += 1
        steps.append(steps_from_vllm(s.get("per_step_accepted", []), s.get("per_step_drafted", []), cl))
    summary = summarize(steps, gamma, _count_classes(classes), source="responses")
    # vLLM's own per-request summary, aggregated, as a cross-check of the per-step arrays
    engine = AcceptanceStats.pooled(AcceptanceStats.from_vllm(c.request_spec_metrics) for c in results)
    summary["engine_counts"] = {"num_spec_steps": engine.steps, "num_accepted_draft_tokens": engine.accepted,
                                "num_draft_tokens": engine.drafted, "tau": engine.tau,
                                "acceptance_rate": engine.rate}
    if method in ("ngram", "schema"):
        # model-free steps that propose nothing are not reported per step, so the per-step counts
        # cannot be placed on output tokens by counting; the proposer is deterministic, so
        # replaying it on (prompt + output) places them (checked per request)
        aligned = _alignment(results, outputs, classes, gamma, spec, tok)
        if aligned.get("by_class_aligned") is not None:
            counts = _count_classes(classes)
            summary["by_class"] = {c: {**v, "tokens": counts.get(c, 0)} for c, v in aligned["by_class_aligned"].items()}
            summary["by_class_note"] = (f"aligned by replaying the {method} proposer on prompt + output; "
                                        f"replay reproduces the engine's per-step counts for "
                                        f"{aligned['replay_agrees_with_engine']}")
        summary["replay_agrees_with_engine"] = aligned.get("replay_agrees_with_engine")
    if method == "hybrid":
        summary["hybrid"] = sp.hybrid_config(str(model_dir)).__dict__
    out_tokens = sum(len(o) for o in outputs)
    summary["replies"] = [{"id": r.id, "token_ids": list(o), "per_step_accepted": (c.request_spec_metrics or {}).get("per_step_accepted")}
                          for r, o, c in zip(reqs, outputs, results)]
    return {**summary, "mode": "vllm", "method": method, "gamma": gamma, "target": str(model_dir),
            "head": str(head_dir) if head_dir else None, "head_version": version_of(head_dir), "n": len(reqs),
            "temperature": 0.0,
            "concurrency": concurrency, "max_tokens": max_tokens, "output_tokens": out_tokens,
            "wall_s": round(wall, 1), "output_tokens_per_s": round(out_tokens / wall, 1) if wall else None,
            "requests_without_step_metrics": missing, "engine": versions, "draft_stop": draft_stop,
            **({"server": ep.url, "served_name": ep.served_name} if server else {})}


def _hybrid_fields(method: str, hybrid: Any) -> dict[str, Any]:
    return {"hybrid": hybrid} if method == "hybrid" and hybrid is not None else {}


def _alignment(results, outputs, classes, gamma, spec, tokenizer=None) -> dict[str, Any]:
    """Replay the deployment's model-free proposer (vLLM's n-gram, or the schema drafter) on each
    (prompt + output) to place its verify steps."""
    from .simulate import simulate_ngram, simulate_proposer, summarize

    sp = spec.speculative
    seqs = []
    for c, out in zip(results, outputs):
        p = c.raw.get("prompt_token_ids") or []
        seqs.append((list(p) + list(out), len(p)))
    if not all(p for _, p in seqs):
        return {"by_class_aligned": None}
    if sp.method == "schema":
        _, steps = simulate_proposer(seqs, gamma, schema_tracks(tokenizer, sp.schema_dict()), classes)
    else:
        _, steps = simulate_ngram(seqs, gamma, sp.prompt_lookup_min or 2, sp.prompt_lookup_max or 4, classes)
    agree = 0
    for c, st in zip(results, steps):
        s = c.request_spec_metrics or {}
        agree += int([x.accepted for x in st] == list(s.get("per_step_accepted", [])))
    return {"by_class_aligned": summarize(steps, gamma)["by_class"], "replay_agrees_with_engine":
            f"{agree}/{len(results)} requests"}


def schema_tracks(tokenizer, schema: dict[str, Any]) -> Callable[[Sequence[int]], Any]:
    """``prompt -> Track`` of the schema drafter over ``schema`` (``drafting.schema``)."""
    from ..drafting.schema import SchemaGrammar

    return SchemaGrammar(tokenizer, schema).track


def requests_failed(ep: Any, failed: int, total: int, first: BaseException) -> Exception:
    """The error for a measurement whose requests failed: a ``DeploymentError`` with the first error of the
    server's own log where this process started the server (a 500 only says "EngineCore encountered an
    issue"), else an ``EndpointError``; both name what to look at."""
    from ..serving.endpoint import EndpointError
    from ..serving.server import DeploymentError

    msg = f"{failed} of {total} requests failed; first: {first}"
    cause = ep.log_cause()
    if cause:
        return DeploymentError(f"{msg}; the server log's first error: {cause}")
    if ep.server is not None:
        return DeploymentError(f"{msg}; the vLLM log records no error (log: {ep.server.log_path})")
    return EndpointError(f"{msg} (the server at {ep.url} says why in its own log)")


def greedy_features(target: str, reqs: Sequence[Request], max_tokens: int = 192, log: Callable[[str], None] = print,
                    enforce_eager: bool = False):
    """Target greedy outputs (vLLM offline) and their features, cached."""
    from transformers import AutoTokenizer

    from ..model.registry import resolve_model
    from ..task.prompts import render
    from .features import FeatureSet, Sampling, build_features

    model_dir = resolve_model(target)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(render(tok, r), add_special_tokens=False).input_ids for r in reqs]
    d, records, shards = build_features(model_dir, prompts, [Sampling(0.0, max_tokens=max_tokens)] * len(prompts),
                                        tag="greedy", enforce_eager=enforce_eager, log=log)
    return model_dir, tok, records, FeatureSet.load(shards)


def measure_simulated(target: str, method: str, gamma: int, reqs: Sequence[Request], head: str | None = None,
                      max_tokens: int = 192, log: Callable[[str], None] = print,
                      progress: Callable[[int, int], None] | None = None, enforce_eager: bool = False,
                      hybrid: Any = None, reply_schema: str | None = None,
                      draft_stop: float | None = None) -> dict[str, Any]:
    from ..model.heads import version_of
    from ..model.registry import resolve_head
    from ..serving.engine import engine_versions
    from .export import load_head
    from .simulate import head_predictions, simulate, simulate_hybrid, simulate_ngram, summarize
    from .train import load_target_weights

    t0 = time.perf_counter()
    model_dir, tok, records, fs = greedy_features(target, reqs, max_tokens, log, enforce_eager)
    classes = classes_for(tok, reqs, [r["output_ids"] for r in records])
    counts = _count_classes(classes)
    head_dir = None
    if method == "eagle3":
        head_dir = resolve_head(head)
        h = load_head(head_dir)
        embed = load_target_weights(model_dir)["embed"].float()
        summary, _ = simulate(h, embed, fs, gamma, classes, progress, stop_p=draft_stop)
    elif method == "hybrid":
        from ..drafting.config import NEEDS_POINTER, NEEDS_SCHEMA, NEEDS_TOKENS, for_target
        from ..drafting.tokens import TokenInfo

        head_dir = resolve_head(head)
        hybrid = for_target(hybrid, model_dir, head_dir)
        info = TokenInfo.from_tokenizer(tok) if hybrid.rule in NEEDS_TOKENS else None
        h = load_head(head_dir)
        embed = load_target_weights(model_dir)["embed"].float()
        pointer = None
        if hybrid.rule in NEEDS_POINTER:
            from ..drafting.pointer import Pointer
            from ..model.registry import check_head

            pdir = Path(hybrid.pointer)
            check_head(pdir, model_dir, what="pointer")
            pointer = Pointer.load(pdir, model_dir)
        grammar = None
        if hybrid.rule in NEEDS_SCHEMA:
            from ..drafting.schema import SchemaGrammar

            from ..serving.spec import reply_schema_of

            grammar = SchemaGrammar(tok, reply_schema_of(reply_schema))
        preds, probs = head_predictions(h, embed, fs, gamma)
        summary, steps = simulate_hybrid(preds, fs, gamma, hybrid, classes, info, pointer, probs, grammar,
                                         stop_p=draft_stop)
        summary["hybrid"] = dict(hybrid.__dict__)
        summary["per_step_accepted"] = [[st.accepted for st in seq] for seq in steps]
    elif method in ("ngram", "schema"):
        seqs = [(list(r["prompt_ids"]) + list(r["output_ids"]), len(r["prompt_ids"])) for r in records]
        if method == "schema":
            from ..serving.spec import reply_schema_of
            from .simulate import simulate_proposer

            summary, _ = simulate_proposer(seqs, gamma, schema_tracks(tok, reply_schema_of(reply_schema)), classes)
        else:
            summary, _ = simulate_ngram(seqs, gamma, 2, 4, classes)
    else:
        raise ValueError(f"cannot simulate method {method!r}")
    for c in summary["by_class"]:
        summary["by_class"][c]["tokens"] = counts.get(c, 0)
    return {**summary, "mode": "simulate", "method": method, "gamma": gamma, "target": str(model_dir),
            "draft_stop": draft_stop,
            "head": str(head_dir) if head_dir else None, "head_version": version_of(head_dir), "n": len(reqs),
            "temperature": 0.0,
            "max_tokens": max_tokens, "output_tokens": sum(len(r["output_ids"]) for r in records),
            "wall_s": round(time.perf_counter() - t0, 1), "engine": engine_versions()}
