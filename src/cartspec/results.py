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
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from .config_files import omit_when_none

from .paths import config_digest
from .task.data import append_jsonl, read_jsonl

SCHEMA_VERSION = 1


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def load_label(mode: str, concurrency: int | None, rate: float | None) -> str:
    """The load of a point as text: ``c=N`` (closed loop) or ``rate=R/s`` (open loop)."""
    return f"c={concurrency}" if mode == "closed" else f"rate={rate:g}/s"


def load_value(mode: str, concurrency: int | None, rate: float | None) -> float | None:
    """The load of a point as a number: requests in flight (closed loop) or arrivals per second (open loop)."""
    value = concurrency if mode == "closed" else rate
    return None if value is None else float(value)


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
        from .machine import engine_versions

        versions = dict(engine_versions())
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        except (ValueError, OSError):
            mem = 0.0
        return cls(hostname=socket.gethostname(), platform=platform.platform(), cpu=versions.get("cpu", "?"),
                   cores=os.cpu_count() or 1, memory_gib=round(mem, 1), versions=versions)


class DeploymentInfo(BaseModel):
    """What served a point: the deployment spec, resolved model and head, engine versions.

    ``deployment_spec`` was written as ``spec`` before; both names load."""

    model_config = ConfigDict(populate_by_name=True)

    label: str
    method: str
    gamma: int | None = None
    head: str | None = None
    head_version: str | None = Field(None, description="NAME@v0002 when the head served is a head registry's version")
    model: str
    deployment_spec: dict[str, Any] = Field(default_factory=dict,
                                            validation_alias=AliasChoices("deployment_spec", "spec"),
                                            description="the DeploymentSpec, as JSON ({} for an external endpoint)")
    url: str = ""
    versions: dict[str, str] = Field(default_factory=dict)
    log_path: str = ""


# The fewest requests per stream in a slice of a point measured in rounds.
SLICE_REQUESTS_PER_STREAM = 2


class PointConfig(BaseModel):
    """Everything that defines one measurement; its digest is the resume key."""

    model_config = ConfigDict(extra="forbid")

    deployment: str  # label, e.g. "baseline", "eagle3-domain-g3"
    method: str
    gamma: int | None = None
    head: str | None = None
    head_version: str | None = Field(None, description="NAME@v0002 when ``head`` resolved to a head registry's "
                                                       "version: a resumed run measures a promoted version anew")
    # kept as the JSON it was written with: the key below is its digest (serving's type sits above this
    # layer); ``analysis.specs.measured_spec`` reads it as a DeploymentSpec
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
    rounds: int = Field(1, ge=1, description="measured in this many slices of consecutive requests, the servers "
                                             "of an interleaved study taking turns at every slice; the slices "
                                             "merge into the point (see ``slice_bounds``)")

    @property
    def key(self) -> str:
        dump = self.model_dump(mode="json")
        for name in ("samples", "rounds"):  # points measured before these existed keep their keys (resume)
            if dump[name] == 1:
                dump.pop(name)
        return config_digest(dump)

    # a head outside a head registry: written (and keyed) as before the field existed
    _without_empty_version = omit_when_none("head_version")

    def slice_bounds(self) -> list[tuple[int, int]]:
        """(first request, requests) of each slice: ``rounds`` runs of consecutive requests, fewer where a
        slice would hold less than two requests per stream (a slice of one request per stream is a burst
        that drains, not the steady load of its concurrency). Request i of the point is request i of one
        slice whatever the split, with the same seed."""
        total = self.n_requests * self.samples
        width = self.concurrency or max(1, round(self.rate or 1))
        k = max(1, min(self.rounds, total // (SLICE_REQUESTS_PER_STREAM * width)))
        return [(j * total // k, (j + 1) * total // k - j * total // k) for j in range(k)]

    @property
    def load(self) -> str:
        """``c=N`` (closed loop) or ``rate=R/s`` (open loop)."""
        return load_label(self.mode, self.concurrency, self.rate)

    @property
    def load_value(self) -> float | None:
        """Concurrency (closed loop) or arrival rate (open loop): the x axis of the study."""
        return load_value(self.mode, self.concurrency, self.rate)


class AcceptanceStats(BaseModel):
    """Draft acceptance counts over some verification steps, and the figures defined on them.

    ``drafted``: draft tokens proposed; ``accepted``: of those, accepted by the target; ``steps``:
    verification steps that carried a draft; ``per_position[i]``: steps whose draft token i was accepted.
    ``rate`` is accepted / drafted and ``tau`` (acceptance length, counting the bonus token) is
    1 + accepted / steps; both are None when there is nothing to divide by: no draft is no observation,
    never a rate of 0. Results written before this model carried the vLLM metric names
    (``draft_tokens``, ``drafts``, ``accepted_per_pos``); they validate into the same fields.
    """

    model_config = ConfigDict(populate_by_name=True)

    drafted: int = Field(0, ge=0, validation_alias=AliasChoices("drafted", "draft_tokens"))
    accepted: int = Field(0, ge=0)
    steps: int = Field(0, ge=0, validation_alias=AliasChoices("steps", "drafts"))
    per_position: list[int] = Field(default_factory=list,
                                    validation_alias=AliasChoices("per_position", "accepted_per_pos"))
    source: Literal["metrics", "responses", "simulated", "offline"] = Field(
        "metrics", description="vLLM's /metrics counters, its per-request metrics, a simulation, or offline "
                               "drafting")

    @field_validator("drafted", "accepted", "steps", mode="before")
    @classmethod
    def _count(cls, v: Any) -> Any:
        return int(round(v)) if isinstance(v, float) else v

    @field_validator("per_position", mode="before")
    @classmethod
    def _counts(cls, v: Any) -> Any:
        return [int(round(x)) if isinstance(x, float) else x for x in v] if v is not None else []

    @property
    def rate(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tau(self) -> float | None:
        """Acceptance length: 1 + accepted / steps; None when no step drafted."""
        return 1.0 + self.accepted / self.steps if self.steps else None

    @property
    def per_position_rate(self) -> list[float]:
        """Per draft position: the share of steps whose token there was accepted; empty without steps."""
        return [a / self.steps for a in self.per_position] if self.steps else []

    def __add__(self, other: "AcceptanceStats") -> "AcceptanceStats":
        n = max(len(self.per_position), len(other.per_position))
        pos = [(self.per_position[i] if i < len(self.per_position) else 0)
               + (other.per_position[i] if i < len(other.per_position) else 0) for i in range(n)]
        return AcceptanceStats(drafted=self.drafted + other.drafted, accepted=self.accepted + other.accepted,
                               steps=self.steps + other.steps, per_position=pos,
                               source=self.source if self.source == other.source else "responses")

    @classmethod
    def pooled(cls, stats: Iterable["AcceptanceStats"], source: str = "responses") -> "AcceptanceStats":
        """Counts summed: the pooled rate weighs each part by its drafted tokens."""
        out = cls(source=source)
        for s in stats:
            out = out + s
        out.source = source
        return out

    @classmethod
    def from_vllm(cls, metrics: dict[str, Any] | None) -> "AcceptanceStats":
        """One reply's counts from vLLM's per-request ``speculative_decoding`` metrics (empty when None)."""
        m = metrics or {}
        return cls(steps=m.get("num_spec_steps", 0) or 0, drafted=m.get("num_draft_tokens", 0) or 0,
                   accepted=m.get("num_accepted_draft_tokens", 0) or 0, source="responses")


class RequestRecord(BaseModel):
    """One measured request. Times in seconds; ``start`` is relative to the point's start.

    ``request_spec_metrics`` was written as ``spec`` before; both names load."""

    model_config = ConfigDict(populate_by_name=True)

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
    request_spec_metrics: dict[str, Any] | None = Field(
        None, validation_alias=AliasChoices("request_spec_metrics", "spec"),
        description="vLLM's per-request speculative metrics (``speculative_decoding`` of the reply)")
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


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The ``q``-th percentile (0..100, linear between samples) of the values that are not None; None for none."""
    arr = [v for v in values if v is not None]
    return float(np.percentile(arr, q)) if arr else None


def _mean(values: Iterable[float | None]) -> float | None:
    arr = [v for v in values if v is not None]
    return float(np.mean(arr)) if arr else None


class PointSlice(BaseModel):
    """One slice of a point measured in rounds: its own wall time and output, so that ratios between
    deployments can be taken slice by slice (each pair measured back to back)."""

    started_at: str = ""
    wall_s: float
    n_requests: int
    output_tokens: int

    @property
    def output_throughput(self) -> float | None:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else None


class PointResult(BaseModel):
    """One measured (or failed) point: its configuration, aggregates and request records.

    ``acceptance`` was written as ``spec`` (with vLLM's counter names) before; both load."""

    model_config = ConfigDict(populate_by_name=True)

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
    acceptance: AcceptanceStats | None = Field(None, validation_alias=AliasChoices("acceptance", "spec"))
    engine_steps: dict[str, dict[str, float]] | None = Field(
        None, description="the engine's steps during the point, by batch bucket: steps, draft_s, verify_s, requests, "
                          "tokens, drafted, kept (cartspec's vLLM plugin, vllm_plugin.steps); None: not known")
    deployment: DeploymentInfo | None = None
    _without_unknown_steps = omit_when_none("engine_steps")
    machine: Machine | None = None
    records: list[RequestRecord] = Field(default_factory=list)
    slices: list[PointSlice] = Field(default_factory=list, description="a point measured in rounds: each "
                                     "slice's wall time and output (merged above); empty: one run")
    beside: list[str] = Field(default_factory=list, description="a point measured in rounds: the deployments "
                              "whose slices alternated with its own (slice j of each measured back to back)")

    @property
    def acceptance_rate(self) -> float | None:
        return self.acceptance.rate if self.acceptance else None

    @property
    def tau(self) -> float | None:
        return self.acceptance.tau if self.acceptance else None

    @classmethod
    def failed(cls, config: PointConfig, reason: str, **kw: Any) -> "PointResult":
        return cls(key=config.key, config=config, status="failed", reason=reason,
                   finished_at=now_iso(), **kw)

    @classmethod
    def measured(cls, config: PointConfig, records: list[RequestRecord], wall_s: float,
                 acceptance: AcceptanceStats | None = None, **kw: Any) -> "PointResult":
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
            ttft_p50=percentile((r.ttft for r in ok), 50), ttft_p99=percentile((r.ttft for r in ok), 99),
            tpot_p50=percentile((r.tpot for r in ok), 50), tpot_p99=percentile((r.tpot for r in ok), 99),
            itl_p50=percentile(itls, 50), itl_p99=percentile(itls, 99),
            e2el_p50=percentile((r.e2el for r in ok), 50), e2el_p90=percentile((r.e2el for r in ok), 90),
            e2el_p99=percentile((r.e2el for r in ok), 99), e2el_mean=_mean(r.e2el for r in ok),
            acceptance=acceptance, records=records, **kw)


# --- the run manifest -----------------------------------------------------------

RUN_FILE = "run.json"


class Invocation(BaseModel):
    """One ``cartspec study`` over a run directory (a resumed run has several)."""

    model_config = ConfigDict(extra="allow")

    started_at: str = ""
    finished_at: str | None = None
    seconds: float | None = None
    points_measured: int | None = None
    points_skipped: int | None = None
    server_api_key_env: str | None = Field(None, description="the variable that held the endpoint's API key "
                                                             "(the key itself is never written)")
    vllm_patches: dict[str, str] | None = Field(None, description="what cartspec's vLLM plugin did in the "
                                                                  "deployments this invocation measured "
                                                                  "(``patch_summary``)")

    _without_absent_patches = omit_when_none("vllm_patches")  # an invocation without the report: as before


class RunManifest(BaseModel):
    """``run.json``: the plan a run directory was measured with, the machine, and every invocation.

    Every field is optional and unknown fields are kept, so any earlier run.json loads."""

    model_config = ConfigDict(extra="allow")

    plan: dict[str, Any] = Field(default_factory=dict, description="the SweepPlan, as JSON")
    machine: Machine | dict[str, Any] | None = Field(None, description="a dict where an old run.json's machine "
                                                                     "lacks fields Machine needs")
    created_at: str = ""
    invocations: list[Invocation] = Field(default_factory=list)

    @property
    def preset(self) -> str | None:
        return self.plan.get("name")

    @property
    def seconds(self) -> float:
        """Sweep time over all invocations (unfinished ones count 0)."""
        return sum(i.seconds or 0 for i in self.invocations)

    @classmethod
    def load(cls, run_dir: str | Path) -> "RunManifest":
        """The run's manifest; an empty one when the directory has no run.json."""
        path = Path(run_dir) / RUN_FILE
        return cls.model_validate_json(path.read_text()) if path.exists() else cls()

    def save(self, run_dir: str | Path) -> None:
        (Path(run_dir) / RUN_FILE).write_text(self.model_dump_json(indent=2, exclude_none=True))


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


def patch_summary(results: list[PointResult]) -> dict[str, str]:
    """Each patch of cartspec's vLLM plugin -> what the run's deployments reported (``versions.vllm_patches``,
    ``cpu_expand=applied, hybrid=skipped, ...``): one status where all agree, else how many said which."""
    seen: dict[str, dict[str, str]] = {}  # deployment label -> its patches
    for r in results:
        d = r.deployment
        text = (d.versions.get("vllm_patches") if d and d.versions else None) or ""
        if text and d.label not in seen:
            seen[d.label] = dict(x.strip().split("=", 1) for x in text.split(",") if "=" in x)
    out: dict[str, str] = {}
    for name in dict.fromkeys(n for patches in seen.values() for n in patches):
        counts: dict[str, int] = {}
        for patches in seen.values():
            status = patches.get(name, "not reported")
            counts[status] = counts.get(status, 0) + 1
        out[name] = (next(iter(counts)) if len(counts) == 1 else
                     ", ".join(f"{s} in {n} of {len(seen)} deployments" for s, n in counts.items()))
    return out


# --- a point beside its baseline -------------------------------------------------------------------------


def comparison_key(config: PointConfig) -> tuple:
    """What a point shares with the baseline it is compared with: the same requests (set and samples per
    request), load, temperature and decoding settings. The speedups, the agreement and the quality tests
    all pair points by this key."""
    c = config
    return (c.request_set, c.mode, c.concurrency, c.rate, c.temperature, c.max_tokens, c.structured, c.samples)


def deployment_tag(label: str) -> str:
    """The tag of a deployment's label (``LABEL@tag``; "" where it has none)."""
    return label.partition("@")[2]


def baselines(results: Iterable[PointResult]) -> dict[tuple, PointResult]:
    """(tag, *``comparison_key``) -> the baseline (no speculation) measured successfully there; look a
    point's up with ``baseline_for``."""
    return {(deployment_tag(r.config.deployment), *comparison_key(r.config)): r for r in results
            if r.status == "ok" and r.config.method == "none"}


def baseline_for(base: dict[tuple, PointResult], config: PointConfig) -> PointResult | None:
    """The baseline a point is compared with, at its ``comparison_key``: the baseline of its own tag where
    the study has one (``eagle3-domain-g3@iomp`` beside ``baseline@iomp``, when a study holds two baselines
    that differ off their speculation), else the untagged one, else the only one there is."""
    key = comparison_key(config)
    hit = base.get((deployment_tag(config.deployment), *key)) or base.get(("", *key))
    if hit is None:
        same = [b for k, b in base.items() if k[1:] == key]
        hit = same[0] if len(same) == 1 else None
    return hit


def matched_records(baseline: PointResult, point: PointResult) -> list[tuple[RequestRecord, RequestRecord]]:
    """(baseline's, point's) replies to the same request and sample, both answered, in the point's order."""
    theirs = {(x.id, x.sample): x for x in baseline.records if x.ok and x.text is not None}
    return [(theirs[(x.id, x.sample)], x) for x in point.records
            if x.ok and x.text is not None and (x.id, x.sample) in theirs]
