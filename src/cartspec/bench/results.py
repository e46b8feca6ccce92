"""Typed study results: one ``PointResult`` per line of ``results.jsonl``.

A result file is an API: every line carries the full point configuration, the
deployment (spec, engine and model versions), the machine, the per-request
records and the aggregates, and loads back into the same model. Metric names
are the usual ones (TTFT, TPOT, ITL, E2EL, output throughput, acceptance rate,
τ, per-position acceptance, goodput).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
from pathlib import Path
from typing import Any, Iterable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..paths import config_digest
from ..task.data import append_jsonl, read_jsonl

SCHEMA_VERSION = 1


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class Machine(BaseModel):
    """Where a point was measured: absolute times only compare on the same machine."""

    hostname: str
    platform: str
    cpu: str
    cores: int
    memory_gib: float
    versions: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def here(cls) -> "Machine":
        from ..serving.engine import engine_versions

        versions = dict(engine_versions())
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        except (ValueError, OSError):
            mem = 0.0
        return cls(hostname=socket.gethostname(), platform=platform.platform(), cpu=versions.get("cpu", "?"),
                   cores=os.cpu_count() or 1, memory_gib=round(mem, 1), versions=versions)


class DeploymentInfo(BaseModel):
    """What served a point: the spec, resolved model and head, engine versions."""

    label: str
    method: str
    gamma: int | None = None
    head: str | None = None
    model: str
    spec: dict[str, Any] = Field(default_factory=dict)
    url: str = ""
    versions: dict[str, str] = Field(default_factory=dict)
    log_path: str = ""


class PointConfig(BaseModel):
    """Everything that defines one measurement; its digest is the resume key."""

    model_config = ConfigDict(extra="forbid")

    deployment: str  # label, e.g. "baseline", "eagle3-domain-g3"
    method: str
    gamma: int | None = None
    head: str | None = None
    spec: dict[str, Any] = Field(default_factory=dict, description="the DeploymentSpec, as JSON")
    mode: Literal["closed", "open"] = "closed"
    concurrency: int | None = Field(None, ge=1, description="closed loop: requests in flight")
    rate: float | None = Field(None, gt=0, description="open loop: Poisson arrivals per second")
    temperature: float = 0.0
    request_set: str = "commerce"
    n_requests: int = Field(..., ge=1, description="measured requests (the warm-up is extra)")
    duration_s: float | None = Field(None, description="stop issuing requests after this many seconds")
    warmup: int = 0
    max_tokens: int = 128
    structured: bool = False
    seed: int = Field(0, description="per-request sampling seeds derive from it at T > 0; negative: none sent")
    slo_e2el_s: float = 2.0
    samples: int = Field(1, ge=1, description="replies per measured request (sample j of request i gets the same "
                                              "seed on every deployment): n_requests x samples replies in all")

    @property
    def key(self) -> str:
        dump = self.model_dump(mode="json")
        if self.samples == 1:  # points measured before samples existed keep their keys (resume)
            dump.pop("samples")
        return config_digest(dump)

    @property
    def load(self) -> str:
        return f"c={self.concurrency}" if self.mode == "closed" else f"rate={self.rate:g}/s"


class SpecStats(BaseModel):
    """Counter deltas over one point, from vLLM's ``/metrics`` (or summed per-request metrics)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: list[float] = Field(default_factory=list)
    source: Literal["metrics", "responses"] = "metrics"

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def tau(self) -> float | None:
        """Acceptance length: 1 + accepted / drafts (counts the bonus token)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def per_position(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []


class RequestRecord(BaseModel):
    """One measured request. Times in seconds; ``start`` is relative to the point's start."""

    id: str = ""
    sample: int = Field(0, description="which of the point's replies to this request (0..samples-1); "
                                       "(id, sample) pairs a reply with another deployment's")
    start: float = 0.0
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = Field(default_factory=list, description="gaps between streamed content chunks")
    output_tokens: int = 0
    prompt_tokens: int = 0
    chunks: int = 0
    usage_reported: bool = False
    error: str | None = None
    status: int = 0
    spec: dict[str, Any] | None = Field(None, description="vLLM per-request speculative metrics (summary)")
    text: str | None = Field(None, description="the reply as streamed")
    task: str | None = Field(None, description="search | support: how the reply is parsed")
    exact: bool | None = Field(None, description="the reply matches the request's gold answer in every field "
                                                 "(scored when measured; None without gold)")

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """(E2EL − TTFT) / (output tokens − 1): per-token time after the first."""
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def _pct(values: Iterable[float | None], q: float) -> float | None:
    arr = [v for v in values if v is not None]
    return float(np.percentile(arr, q)) if arr else None


def _mean(values: Iterable[float | None]) -> float | None:
    arr = [v for v in values if v is not None]
    return float(np.mean(arr)) if arr else None


class PointResult(BaseModel):
    schema_version: int = SCHEMA_VERSION
    key: str
    config: PointConfig
    status: Literal["ok", "failed"]
    reason: str | None = None
    started_at: str = ""
    finished_at: str = ""
    wall_s: float = 0.0
    n_requests: int = 0
    n_errors: int = 0
    n_warmup: int = 0
    output_tokens: int = 0
    output_throughput: float | None = None  # output tokens / wall time of the run
    request_throughput: float | None = None
    goodput: float | None = None  # requests/s meeting the E2EL SLO
    slo_attainment: float | None = None  # fraction of requests meeting the SLO (errors miss it)
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    e2el_p50: float | None = None
    e2el_p90: float | None = None
    e2el_p99: float | None = None
    e2el_mean: float | None = None
    json_valid: float | None = None  # share of answered requests whose reply parses as JSON
    exact_match: float | None = None  # share of answered requests with gold whose reply equals it, all fields
    spec: SpecStats | None = None
    deployment: DeploymentInfo | None = None
    machine: Machine | None = None
    records: list[RequestRecord] = Field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.spec.acceptance_rate if self.spec else None

    @property
    def tau(self) -> float | None:
        return self.spec.tau if self.spec else None

    @classmethod
    def failed(cls, config: PointConfig, reason: str, **kw: Any) -> "PointResult":
        return cls(key=config.key, config=config, status="failed", reason=reason,
                   finished_at=now_iso(), **kw)

    @classmethod
    def measured(cls, config: PointConfig, records: list[RequestRecord], wall_s: float,
                 spec: SpecStats | None = None, **kw: Any) -> "PointResult":
        ok = [r for r in records if r.ok]
        tokens = sum(r.output_tokens for r in ok)
        slo = config.slo_e2el_s
        good = sum(1 for r in ok if r.e2el is not None and r.e2el <= slo)
        itls = [g for r in ok for g in r.itl]
        return cls(
            key=config.key, config=config, status="ok", finished_at=now_iso(), wall_s=wall_s,
            n_requests=len(records), n_errors=len(records) - len(ok), output_tokens=tokens,
            output_throughput=tokens / wall_s if wall_s > 0 else None,
            request_throughput=len(ok) / wall_s if wall_s > 0 else None,
            goodput=good / wall_s if wall_s > 0 else None,
            slo_attainment=good / len(records) if records else None,
            ttft_p50=_pct((r.ttft for r in ok), 50), ttft_p99=_pct((r.ttft for r in ok), 99),
            tpot_p50=_pct((r.tpot for r in ok), 50), tpot_p99=_pct((r.tpot for r in ok), 99),
            itl_p50=_pct(itls, 50), itl_p99=_pct(itls, 99),
            e2el_p50=_pct((r.e2el for r in ok), 50), e2el_p90=_pct((r.e2el for r in ok), 90),
            e2el_p99=_pct((r.e2el for r in ok), 99), e2el_mean=_mean(r.e2el for r in ok),
            spec=spec, records=records, **kw)


# --- the results file ---------------------------------------------------------

RESULTS_FILE = "results.jsonl"


def results_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / RESULTS_FILE


def append_result(run_dir: str | Path, result: PointResult) -> None:
    path = results_path(run_dir)
    if path.exists() and path.stat().st_size:
        with path.open("rb+") as fh:  # a torn last line from a kill must not swallow this record
            fh.seek(-1, 2)
            if fh.read(1) != b"\n":
                fh.write(b"\n")
    append_jsonl(path, result)


def load_results(run_dir: str | Path) -> list[PointResult]:
    """Every point of a run; where a point was measured more than once the last line wins.

    A torn last line (a sweep killed while writing) is skipped, so that point is
    simply not finished and a rerun measures it.
    """
    latest: dict[str, PointResult] = {}
    for row in read_jsonl(results_path(run_dir)):
        try:
            res = PointResult.model_validate(row)
        except ValueError:
            continue
        latest.pop(res.key, None)
        latest[res.key] = res
    return list(latest.values())


def finished_keys(run_dir: str | Path) -> set[str]:
    """Points a rerun skips: those measured successfully. Failed points are retried."""
    return {r.key for r in load_results(run_dir) if r.status == "ok"}
