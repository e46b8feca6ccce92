"""Acceptance per token class for every speculative deployment of a study (rendered by ``report.classes``).

A study record keeps the reply's text and vLLM's per-request speculative metrics,
including, with ``--per-request-spec-decode-metrics detailed`` (every server
cartspec starts), the accepted and drafted counts of each verify step
(``per_step_accepted`` / ``per_step_drafted``). The reply's tokens are recovered by
re-tokenising the text with the target's tokenizer (plus the end-of-turn token
when the reply stopped on it); a reply is used only when that gives exactly the
number of output tokens vLLM reported, so a step is never placed on the wrong
token. The classes (``task.classes``: JSON structure, keys, values copied from
the request, values not in it, free text) and the placement of steps
(``draft.simulate.steps_from_vllm``) are those of ``cartspec draft acceptance``.
A reply that re-tokenises differently is counted in ``replies_skipped``.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

from pydantic import BaseModel

from ..task.classes import CLASSES
from ..results import PointResult
from ..task.request_sets import load_request_set
from .specs import measured_spec


class ClassAcceptance(BaseModel):
    """One speculative deployment at one temperature and request set, its loads pooled."""

    deployment: str
    temperature: float
    request_set: str
    tau: float | None
    acceptance_rate: float | None
    verify_steps: int
    replies: int
    replies_skipped: int
    by_class: dict[str, float | None]
    reached: dict[str, int]


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _model_dir(r: PointResult) -> str | None:
    from pathlib import Path

    d = r.deployment
    if d is not None and d.versions.get("model_dir") and Path(d.versions["model_dir"]).is_dir():
        return d.versions["model_dir"]
    spec = measured_spec(r.config)
    model = spec.model if spec else None
    if model is None:
        return None
    try:
        from ..model.registry import resolve_model

        return str(resolve_model(model))
    except Exception:
        return None


@functools.lru_cache(maxsize=8)
def _requests(request_set: str, n: int) -> dict[str, Any]:
    return {r.id or "": r for r in load_request_set(request_set, n)}


def reply_ids(tok, text: str, output_tokens: int) -> list[int] | None:
    """The reply's token ids, re-tokenised; None unless they number ``output_tokens``."""
    ids = tok(text, add_special_tokens=False).input_ids
    if len(ids) == output_tokens - 1 and tok.eos_token_id is not None:
        ids = ids + [tok.eos_token_id]
    return ids if len(ids) == output_tokens else None


def acceptance_by_class(results: list[PointResult]) -> list[ClassAcceptance]:
    """One row per speculative deployment, temperature and request set (loads pooled): τ, acceptance
    and acceptance per token class from the per-step counts; empty where none were recorded."""
    from ..task.classes import request_text, token_classes
    from ..draft.simulate import steps_from_vllm, summarize

    groups: dict[tuple, list[PointResult]] = defaultdict(list)
    for r in results:
        if r.status == "ok" and r.config.method != "none":
            groups[(r.config.deployment, r.config.temperature, r.config.request_set)].append(r)
    rows = []
    for (dep, temp, rs), points in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        recs = [(p, x) for p in points for x in p.records if x.ok and x.text is not None
                and (x.request_spec_metrics or {}).get("per_step_accepted") is not None]
        if not recs:
            continue
        model = _model_dir(points[0])
        if model is None:
            continue
        tok = _tokenizer(model)
        n_req = max(p.config.n_requests + p.config.warmup for p in points)
        by_id = _requests(rs, n_req)
        steps, skipped, gamma = [], 0, 0
        for p, x in recs:
            req = by_id.get(x.id)
            ids = reply_ids(tok, x.text, x.output_tokens) if req is not None else None
            if ids is None:
                skipped += 1
                continue
            drafted = x.request_spec_metrics.get("per_step_drafted") or []
            gamma = max([gamma, *drafted])
            steps.append(steps_from_vllm(x.request_spec_metrics["per_step_accepted"], drafted,
                                         token_classes(tok, ids, request_text(req))))
        if not steps:
            continue
        s = summarize(steps, max(gamma, 1), source="responses")
        rows.append(ClassAcceptance(deployment=dep, temperature=temp, request_set=rs, tau=s["tau"],
                                    acceptance_rate=s["acceptance_rate"], verify_steps=s["verify_steps"],
                                    replies=len(steps), replies_skipped=skipped,
                                    by_class={c: s["by_class"][c]["acceptance"] for c in CLASSES},
                                    reached={c: s["by_class"][c]["reached"] for c in CLASSES}))
    return rows
