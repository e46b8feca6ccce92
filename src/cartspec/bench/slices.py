"""Measuring a point slice by slice, and merging its slices into the point's one result.

A point in rounds (``PointConfig.slice_bounds``) is measured as runs of consecutive requests, the deployments
of an interleaved group taking turns at each slice (``bench/grouping.py``); its slices merge into one
``PointResult`` on one clock. A point not in rounds is a single slice.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Sequence

from ..results import DeploymentInfo, Machine, PointConfig, PointResult, PointSlice, RequestRecord, now_iso
from ..serving.endpoint import Endpoint
from ..task.request_sets import load_request_set
from .loadgen import ChatRequest, LoadConfig, LoadResult, chat_requests, run_load
from .reporter import Reporter
from .scoring import reply_quality, score_replies, with_scores


def with_samples(requests: list[ChatRequest], n: int, samples: int) -> list[ChatRequest]:
    """The first ``n`` requests, each ``samples`` times in a row (sample 0, 1, ...), then the rest (the
    warm-up takes its requests from the end). The load generator seeds the i-th measured request
    ``seed * 100003 + i``, so sample j of request r gets seed ``seed * 100003 + r * samples + j`` on every
    deployment: a speculative reply pairs with the baseline's drawn with the same seed."""
    if samples <= 1:
        return requests
    head = [dataclasses.replace(r, sample=j) for r in requests[:n] for j in range(samples)]
    return head + list(requests[n:])


@dataclass
class Slice:
    """One slice of a point, measured; the point's slices merge into its result (``merged_point``)."""

    started_at: str
    load: LoadResult
    requests: list[ChatRequest]


def measure_slice(cfg: PointConfig, ep: Endpoint, info: DeploymentInfo, machine: Machine, reporter: Reporter,
                  part: int = 0, done: Sequence[Slice] = (), warm: bool = True) -> Slice | PointResult:
    """Run slice ``part`` of ``cfg``, after the point's warm-up where ``warm`` (its first slice, and the first
    slice on a server that was just started); a failed point when the slice fails or the server died (with the
    records of the slices ``done`` before it and this one's)."""
    started = now_iso()
    bounds = cfg.slice_bounds()
    offset, count = bounds[part]
    try:
        if done:  # the point's request list, built for its first slice
            requests = done[0].requests
        else:
            requests = chat_requests(load_request_set(cfg.request_set, cfg.n_requests + cfg.warmup),
                                     cfg.max_tokens, cfg.structured)
            requests = with_samples(requests, cfg.n_requests, cfg.samples)
        load = LoadConfig(mode=cfg.mode, concurrency=cfg.concurrency or 1, rate=cfg.rate, n_requests=count,
                          offset=offset, warmup=cfg.warmup if warm else 0,
                          duration_s=cfg.duration_s / len(bounds) if cfg.duration_s else None,
                          temperature=cfg.temperature, seed=cfg.seed)
        result = asyncio.run(run_load(ep.url, ep.served_name, requests, load,
                                      on_done=lambda r: reporter.request_done(r.ok), api_key=ep.api_key,
                                      metrics=ep.has_metrics, step_stats=ep.step_stats_path))
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if not ep.alive():
            reason = ep.died_reason()
        return failed_point(cfg, reason, done, None, started, info, machine)
    if not ep.alive():
        return failed_point(cfg, ep.died_reason(), done, result, started, info, machine)
    return Slice(started, result, requests)


def failed_point(cfg: PointConfig, reason: str, done: Sequence[Slice], last: LoadResult | None, started: str,
                 info: DeploymentInfo, machine: Machine) -> PointResult:
    """The point failed in a slice: recorded with the requests of the slices before it (and of the failed one
    when it ran to its end)."""
    records = [rec for s in done for rec in s.load.records] + (last.records if last else [])
    wall = sum(s.load.wall_s for s in done) + (last.wall_s if last else 0.0)
    return PointResult.failed(cfg, reason[:2000], started_at=done[0].started_at if done else started,
                              machine=machine, deployment=info, records=records, wall_s=wall,
                              n_requests=len(records), n_errors=sum(1 for r in records if not r.ok))


def merged_point(cfg: PointConfig, slices: Sequence[Slice], info: DeploymentInfo, machine: Machine,
                 beside: Sequence[str] = ()) -> PointResult:
    """The point from its slices: their records on one clock (each slice's after the wall time of those
    before it), wall times and acceptance counters summed; each slice's own figures kept in ``slices``."""
    records: list[RequestRecord] = []
    acceptance = None
    engine_steps: dict[str, dict[str, float]] = {}
    shift = 0.0
    for s in slices:
        records += [rec.model_copy(update={"start": rec.start + shift}) for rec in s.load.records]
        shift += s.load.wall_s
        if s.load.acceptance is not None:
            acceptance = s.load.acceptance if acceptance is None else acceptance + s.load.acceptance
        if s.load.engine_steps:
            for b, row in s.load.engine_steps.items():
                acc = engine_steps.setdefault(b, {})
                for f, v in row.items():
                    acc[f] = acc.get(f, 0.0) + v
    scores = score_replies(records, slices[0].requests)
    json_valid, exact = reply_quality(scores)
    records = with_scores(records, scores)
    parts = [PointSlice(started_at=s.started_at, wall_s=s.load.wall_s, n_requests=len(s.load.records),
                        output_tokens=sum(r.output_tokens for r in s.load.records if r.ok))
             for s in slices] if len(slices) > 1 else []
    res = PointResult.measured(cfg, records, shift, acceptance, started_at=slices[0].started_at,
                               machine=machine, deployment=info, n_warmup=sum(s.load.n_warmup for s in slices),
                               json_valid=json_valid, exact_match=exact, slices=parts,
                               engine_steps=engine_steps or None,
                               beside=list(beside) if parts else [])
    if res.n_errors == res.n_requests:
        first = next((r.error for r in records if r.error), "")
        return PointResult.failed(cfg, f"every request failed: {first}", started_at=slices[0].started_at,
                                  machine=machine, deployment=info, records=records, wall_s=shift,
                                  n_requests=res.n_requests, n_errors=res.n_errors)
    return res
