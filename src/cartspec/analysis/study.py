"""A study run, analysed: ``results.jsonl`` (+ ``run.json``, ``quality.json``) -> a typed ``StudyAnalysis``.

Everything the report shows is computed here, once, from the results file, so
``cartspec report --run DIR`` rebuilds the same analysis at any time, and
``summary.json`` is ``StudyAnalysis.model_dump(mode="json")`` (it loads back with
``StudyAnalysis.model_validate_json``). Speedups are ratios of points measured in
the same run on the same machine: absolute times on shared machines drift,
ratios hold.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Sequence

from pydantic import BaseModel, Field

from ..quality.models import JudgeCalibration, QualityEntry, QualityReport
from ..results import (Invocation, Machine, PointResult, RunManifest, baselines, comparison_key, load_label,
                       load_results, load_value, matched_records)
from ..serving.spec import schedule_gamma
from .classes import ClassAcceptance
from .cost_model import PointPrediction, StepCosts

SUMMARY_FILE = "summary.json"

# The published study (PayPal Commerce Agent: llama3.1-nemotron-nano-8B + LoRA, EAGLE-3 on vLLM, 2xH100), for the side-by-side table.
PUBLISHED = {
    "gain_g3": "+22% to +49%",
    "latency_g3": "18% to 33% lower",
    "accept_g3": "about 35.5%, stable across conditions",
    "accept_g5": "about 25%; gains shrink, slower at high concurrency",
    "one_vs_two": "one GPU with speculation matches or beats two without",
    "quality": "preserved (LLM-as-judge, pairwise)",
}

DEFINITIONS = {
    "ttft": "request start -> first content chunk (s)", "e2el": "request start -> last content chunk (s)",
    "tpot": "(E2EL - TTFT) / (output tokens - 1), per request (s)",
    "itl": "gaps between streamed content chunks (s); several tokens may share a chunk",
    "output_throughput": "output tokens / wall time of the measured run (tokens/s)",
    "acceptance_rate": "accepted draft tokens / proposed draft tokens",
    "tau": "1 + accepted / drafts", "goodput": "requests/s with E2EL <= SLO",
    "speedup_vs_baseline": "output_throughput / baseline's at the same load, temperature and request set",
    "json_valid": "share of answered requests whose reply parses as JSON",
    "exact_match": "share of answered requests whose reply matches the gold answer in every field",
    "agreement_vs_baseline": "T=0 only: share of requests whose reply is identical to the baseline's"}


# --- the models ---------------------------------------------------------------------------------------


class StudyRow(BaseModel):
    """One point of the study, with its comparison to the baseline at the same load, temperature and set."""

    deployment: str
    method: str
    gamma: int | None = None
    head: str | None = None
    mode: Literal["closed", "open"] = "closed"
    concurrency: int | None = None
    rate: float | None = None
    temperature: float = 0.0
    request_set: str = "commerce"
    dtype: str | None = None
    status: Literal["ok", "failed"]
    reason: str | None = None
    n_requests: int = 0
    n_errors: int = 0
    wall_s: float = 0.0
    output_throughput: float | None = None
    request_throughput: float | None = None
    goodput: float | None = None
    slo_attainment: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    e2el_p50: float | None = None
    e2el_p90: float | None = None
    e2el_p99: float | None = None
    acceptance_rate: float | None = None
    tau: float | None = None
    acceptance_per_position: list[float] | None = None
    speedup_vs_baseline: float | None = None
    speedup_ci95: tuple[float, float] | None = Field(None, description="95% interval of the speedup from the "
                                                     "point's slices, each paired with the baseline's measured "
                                                     "beside it (points in rounds only)")
    e2el_p50_ratio_vs_baseline: float | None = None
    json_valid: float | None = None
    exact_match: float | None = None
    agreement_vs_baseline: float | None = None
    key: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def speculative(self) -> bool:
        return self.method != "none"

    @property
    def load(self) -> str:
        """``c=N`` (closed loop) or ``rate=R/s`` (open loop), as ``PointConfig.load``."""
        return load_label(self.mode, self.concurrency, self.rate)

    @property
    def load_value(self) -> float | None:
        """Concurrency (closed loop) or arrival rate (open loop): the x axis of the study."""
        return load_value(self.mode, self.concurrency, self.rate)

    @property
    def speedup(self) -> float | None:
        """Output throughput over the baseline's at the same load, temperature and request set."""
        return self.speedup_vs_baseline


class CapacityRow(BaseModel):
    """The most goodput one instance of a deployment gave under the SLO, and the instances a target needs."""

    deployment: str
    method: str
    gamma: int | None = None
    temperature: float
    request_set: str
    capacity_rps: float
    at_load: int | float | None = None
    mode: Literal["closed", "open"] = "closed"
    slo_attainment: float | None = None
    e2el_p99: float | None = None
    target_rps: float | None = None
    instances_needed: int | None = None


class QualityTest(BaseModel):
    """A speculative deployment's replies paired with the baseline's (``quality.agreement.compare_scored``)."""

    deployment: str
    temperature: float
    request_set: str
    pairs: int
    requests: int
    exact_text: float
    same_parsed: float
    accuracy_baseline: float
    accuracy_candidate: float
    diff: float
    diff_ci95: tuple[float, float]
    mcnemar_p: float
    margin: float
    verdict: str


class Comparison(BaseModel):
    """One finding of the published study beside this run's figure."""

    finding: str
    published: str
    ours: str


class AdaptiveRow(BaseModel):
    """An adaptive (γ per batch size) point beside the best fixed deployment at the same load and T."""

    deployment: str
    temperature: float
    concurrency: int | None = None
    gamma_at_load: int | None = None
    output_throughput: float
    best_fixed: str
    best_fixed_throughput: float
    vs_best_fixed: float
    vs_baseline: float | None = None
    vs_best_fixed_ci95: tuple[float, float] | None = Field(None, description="95% interval from the slices "
                                                           "(points in rounds only)")
    vs_baseline_ci95: tuple[float, float] | None = None
    meets: bool = Field(..., description="≥ 0.95 × the best fixed deployment and ≥ 1.0 × the baseline")
    within_noise: bool | None = Field(None, description="missed, but both intervals reach the goal: these "
                                                        "points cannot tell it from meeting it (rounds only)")
    schedule: list[list[int]] = Field(default_factory=list, description="[first batch size, last, γ] ranges")
    same_gamma: str | None = Field(None, description="the fixed deployment (same method and head) that runs the "
                                                     "γ the schedule runs at this load; the baseline where it is 0")
    vs_same_gamma: float | None = Field(None, description="× that deployment: two servers drafting alike, so "
                                                          "what separates them is noise (or the schedule's cost)")
    vs_same_gamma_ci95: tuple[float, float] | None = None


class CostModelFit(BaseModel):
    """The machine's fitted step costs and how well they predict this run's points."""

    fitted: Literal[True] = True
    coefficients: StepCosts
    n_points: int
    median_abs_error: float
    loo_median_abs_error: float | None = None
    machine: str = ""
    points: list[PointPrediction] = Field(default_factory=list)


class CostModelMissing(BaseModel):
    """Why the cost model could not be fitted on this run."""

    fitted: Literal[False] = False
    reason: str


CostModelSection = Annotated[CostModelFit | CostModelMissing, Field(discriminator="fitted")]


class QualityJudge(BaseModel):
    """Which judge ``cartspec quality`` ran, and its calibrations."""

    judge: dict[str, Any] | None = None
    calibrations: dict[str, JudgeCalibration] = Field(default_factory=dict)
    metric: str | None = None
    margin: float | None = None


class RunInfo(BaseModel):
    """Where and how the run was measured."""

    dir: str
    preset: str | None = None
    machine: Machine | dict[str, Any] = Field(default_factory=dict)
    engine: dict[str, str] = Field(default_factory=dict)
    invocations: list[Invocation] = Field(default_factory=list)
    dtypes: list[str] = Field(default_factory=list)
    seconds: float = 0
    interleave: int = Field(1, description="servers up at once, measured in turn at every point; 1: one "
                                           "deployment after another (ratios then carry the host's drift)")
    rounds: int = Field(1, description="slices per point, the servers taking turns at every slice")
    restart_rounds: bool = Field(False, description="servers started again between rounds, in rotated order")


class StudyAnalysis(BaseModel):
    """The whole analysis of a study run; ``summary.json`` is its JSON dump."""

    run: RunInfo
    slo_e2el_s: float
    target_rps: float | None = None
    points: list[StudyRow] = Field(default_factory=list)
    capacity: list[CapacityRow] = Field(default_factory=list)
    quality_tests: list[QualityTest] = Field(default_factory=list)
    published_comparison: list[Comparison] = Field(default_factory=list)
    verdict: str = ""
    quality: list[QualityEntry] = Field(default_factory=list, description="`cartspec quality`'s entries")
    quality_judge: QualityJudge | None = None
    quality_metric: str | None = Field(None, description="the metric `cartspec quality` rests its verdicts on")
    quality_margin: float | None = None
    definitions: dict[str, str] = Field(default_factory=lambda: dict(DEFINITIONS))
    cost_model: CostModelSection = Field(default_factory=lambda: CostModelMissing(reason="no points"))
    adaptive: list[AdaptiveRow] = Field(default_factory=list)
    acceptance_by_class: list[ClassAcceptance] = Field(default_factory=list)

    @property
    def ok_points(self) -> list[StudyRow]:
        return [r for r in self.points if r.ok]

    def quality_report(self) -> QualityReport | None:
        """What ``cartspec quality`` wrote, as the summary carries it; None when it has not run."""
        if not self.quality and self.quality_metric is None:
            return None
        judge = self.quality_judge or QualityJudge()
        defaults = QualityReport()
        return QualityReport(entries=self.quality, metric=self.quality_metric or defaults.metric,
                             margin=defaults.margin if self.quality_margin is None else self.quality_margin,
                             judge=judge.judge, calibrations=judge.calibrations)

    def save(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / SUMMARY_FILE
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def load(cls, run_dir: str | Path) -> "StudyAnalysis":
        return cls.model_validate_json((Path(run_dir) / SUMMARY_FILE).read_text())


# --- rows ---------------------------------------------------------------------------------------------


def baseline_agreement(r: PointResult, b: PointResult) -> float | None:
    """At T = 0: the share of requests (by id, answered by both) whose reply is character-for-character
    the baseline's. Speculative decoding must not change greedy output; batch-shape numerics may, rarely."""
    if r.config.temperature != 0 or b.config.temperature != 0:
        return None
    pairs = matched_records(b, r)
    return sum(x.text == y.text for x, y in pairs) / len(pairs) if pairs else None


# Student's t two-sided 95% quantiles for 1..10 degrees of freedom (beyond: 1.96 + 2.4 / df, within 1%).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def slice_ratio_ci(a: PointResult, b: PointResult) -> tuple[float, float] | None:
    """95% interval of ``a``'s output throughput over ``b``'s from points measured in rounds: slice j of
    each was measured back to back (seconds apart, the same requests), so the log-ratios of the slices
    are paired observations of the ratio; a t interval on their mean, exponentiated. None unless both
    points have the same two or more slices and were measured beside each other (slices of deployments
    measured in different groups, or one after another, are minutes apart: they pair nothing)."""
    return pooled_ratio_ci([(a, b)])


def pooled_ratio_ci(pairs: Sequence[tuple[PointResult, PointResult]]) -> tuple[float, float] | None:
    """``slice_ratio_ci`` over the paired slices of several (a, b) points, e.g. the same load measured in
    several runs: every pair of slices measured back to back is one observation of the ratio. Points that
    pair no slices contribute nothing; None with fewer than two observations."""
    logs = []
    for a, b in pairs:
        if len(a.slices) < 2 or len(a.slices) != len(b.slices) or b.config.deployment not in a.beside:
            continue
        logs += [math.log(x.output_throughput / y.output_throughput) for x, y in zip(a.slices, b.slices)
                 if x.output_throughput and y.output_throughput]
    k = len(logs)
    if k < 2:
        return None
    mean = sum(logs) / k
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / (k - 1))
    t = _T975[k - 2] if k - 1 <= len(_T975) else 1.96 + 2.4 / (k - 1)
    half = t * sd / math.sqrt(k)
    return math.exp(mean - half), math.exp(mean + half)


def study_rows(results: list[PointResult]) -> list[StudyRow]:
    """One row per point, with the speedup over the baseline at the same load and temperature."""
    base = baselines(results)
    rows = []
    for r in sorted(results, key=lambda r: (r.config.deployment, r.config.request_set, r.config.temperature,
                                            r.config.load_value)):
        c = r.config
        b = base.get(comparison_key(c))
        ok = r.status == "ok"
        speedup = (r.output_throughput / b.output_throughput
                   if ok and b and b.output_throughput and r.output_throughput is not None else None)
        lat = (r.e2el_p50 / b.e2el_p50 if ok and b and b.e2el_p50 and r.e2el_p50 is not None else None)
        agree = baseline_agreement(r, b) if ok and b and c.method != "none" else None
        rows.append(StudyRow(
            deployment=c.deployment, method=c.method, gamma=c.gamma, head=c.head, mode=c.mode,
            concurrency=c.concurrency, rate=c.rate, temperature=c.temperature, request_set=c.request_set,
            dtype=(c.spec or {}).get("dtype"), status=r.status, reason=r.reason,
            n_requests=r.n_requests, n_errors=r.n_errors, wall_s=r.wall_s,
            output_throughput=r.output_throughput, request_throughput=r.request_throughput,
            goodput=r.goodput, slo_attainment=r.slo_attainment,
            ttft_p50=r.ttft_p50, ttft_p99=r.ttft_p99, tpot_p50=r.tpot_p50, tpot_p99=r.tpot_p99,
            itl_p50=r.itl_p50, itl_p99=r.itl_p99, e2el_p50=r.e2el_p50, e2el_p90=r.e2el_p90, e2el_p99=r.e2el_p99,
            acceptance_rate=r.acceptance_rate, tau=r.tau,
            acceptance_per_position=r.acceptance.per_position_rate if r.acceptance else None,
            speedup_vs_baseline=speedup, e2el_p50_ratio_vs_baseline=lat,
            speedup_ci95=slice_ratio_ci(r, b) if speedup is not None and c.method != "none" else None,
            json_valid=r.json_valid, exact_match=r.exact_match, agreement_vs_baseline=agree, key=r.key))
    return rows


def quality_tests(results: list[PointResult]) -> list[QualityTest]:
    """Per speculative deployment, temperature and request set: its replies against the baseline's to the
    same requests at the same loads (``quality/agreement.py``): identical text, equal parsed JSON, and the
    paired difference in exact match against gold with a 95% bootstrap interval and an exact sign test.
    A request answered at several loads is one cluster (resampled together), not several samples.
    Uses the scores each record got when it was measured (results from before they were kept: skipped)."""
    from ..quality.agreement import compare_scored

    base = baselines(results)
    pairs: dict[tuple, list[tuple]] = {}
    for r in results:
        b = base.get(comparison_key(r.config))
        if r.status != "ok" or r.config.method == "none" or b is None:
            continue
        key = (r.config.deployment, r.config.temperature, r.config.request_set)
        pairs.setdefault(key, []).extend((x.task or "search", y, x) for y, x in matched_records(b, r)
                                         if x.exact is not None and y.exact is not None)
    out = []
    for (dep, temp, rs), ps in sorted(pairs.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        if not ps:
            continue
        a = compare_scored([p[0] for p in ps], [p[1].text for p in ps], [p[2].text for p in ps],
                           [bool(p[1].exact) for p in ps], [bool(p[2].exact) for p in ps],
                           clusters=[p[2].id for p in ps])
        out.append(QualityTest(deployment=dep, temperature=temp, request_set=rs, pairs=a.n,
                               requests=len({p[2].id for p in ps}),
                               **{k: v for k, v in a.to_dict().items() if k != "n"}))
    return out


# --- capacity -----------------------------------------------------------------------------------------


def capacity_table(rows: list[StudyRow], target_rps: float | None) -> tuple[list[CapacityRow], float | None]:
    """Per deployment (and temperature): the most goodput one instance gives under the SLO, and
    how many instances a target load needs. Default target: twice the baseline's capacity at T=0,
    the study's "one GPU instead of two" question restated for this machine."""
    groups: dict[tuple, list[StudyRow]] = {}
    for r in rows:
        if r.ok:
            groups.setdefault((r.deployment, r.temperature, r.request_set), []).append(r)
    caps = []
    for (dep, temp, rs), pts in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        best = max(pts, key=lambda p: p.goodput or 0.0)
        caps.append(CapacityRow(deployment=dep, method=best.method, gamma=best.gamma, temperature=temp,
                                request_set=rs, capacity_rps=best.goodput or 0.0,
                                at_load=best.concurrency if best.mode == "closed" else best.rate,
                                mode=best.mode, slo_attainment=best.slo_attainment, e2el_p99=best.e2el_p99))
    if target_rps is None:
        b = [c for c in caps if c.method == "none"]
        b0 = min(b, key=lambda c: c.temperature) if b else None
        target_rps = 2 * b0.capacity_rps if b0 and b0.capacity_rps > 0 else None
    for c in caps:
        c.target_rps = target_rps
        c.instances_needed = (math.ceil(target_rps / c.capacity_rps - 1e-9)
                              if target_rps and c.capacity_rps > 0 else None)
    return caps, target_rps


# --- comparison with the published study --------------------------------------------------------------


def _rng(values: Iterable[float | None], fmt: str) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return "not measured"
    lo, hi = min(v), max(v)
    return fmt.format(lo) if abs(hi - lo) < 1e-9 else f"{fmt.format(lo)} to {fmt.format(hi)}"


def published_comparison(rows: list[StudyRow], caps: list[CapacityRow], tests: list[QualityTest] | None = None,
                         quality: QualityReport | None = None) -> list[Comparison]:
    ok = [r for r in rows if r.ok and r.speculative]
    out = []
    # One row per temperature: pooling greedy and sampled points would hide what either does.
    for g, dep, temp in sorted({(r.gamma, r.deployment, r.temperature) for r in ok if r.gamma}):
        pts = [r for r in ok if r.deployment == dep and r.temperature == temp]
        dep = f"{dep}, T={temp:g}"
        out.append(Comparison(finding=f"γ={g} throughput gain over baseline ({dep})",
                              published=PUBLISHED["gain_g3"] if g == 3 else "smaller than γ=3",
                              ours=_rng(((r.speedup - 1) * 100 if r.speedup else None for r in pts), "{:+.0f}%")))
        out.append(Comparison(finding=f"γ={g} E2EL p50 reduction ({dep})",
                              published=PUBLISHED["latency_g3"] if g == 3 else "smaller than γ=3",
                              ours=_rng(((1 - r.e2el_p50_ratio_vs_baseline) * 100
                                         if r.e2el_p50_ratio_vs_baseline else None for r in pts), "{:.0f}%")))
        acc = [r.acceptance_rate for r in pts if r.acceptance_rate is not None]
        mean = f"mean {sum(acc) / len(acc):.1%}, " if acc else ""
        out.append(Comparison(finding=f"acceptance rate, γ={g} ({dep})",
                              published=(PUBLISHED["accept_g3"] if g == 3 else PUBLISHED["accept_g5"] if g == 5
                                         else "—"),
                              ours=(mean + _rng(acc, "{:.1%}")) if acc else "not measured"))
    base = [c for c in caps if c.method == "none"]
    spec = [c for c in caps if c.method != "none"]
    if base and spec:
        parts = []
        for temp in sorted({c.temperature for c in base}):
            b = next((c for c in base if c.temperature == temp), None)
            s = max((c for c in spec if c.temperature == temp), key=lambda c: c.capacity_rps, default=None)
            if b and s and b.capacity_rps > 0:
                parts.append(f"T={temp:g}: best speculative ({s.deployment}) sustains "
                             f"{s.capacity_rps / b.capacity_rps:.2f}× the baseline's goodput")
        out.append(Comparison(finding="one instance with speculation vs two without", published=PUBLISHED["one_vs_two"],
                              ours="; ".join(parts) + " (2.00× would replace two instances with one)" if parts
                              else "not measured"))
    if quality and quality.entries:  # `cartspec quality` ran: like beside like
        from ..quality.report import judge_comparison, structured_comparison

        out.append(Comparison(finding="quality: LLM-as-judge, pairwise", published=PUBLISHED["quality"],
                              ours=judge_comparison(quality)))
        out.append(Comparison(finding="quality: paired structured tests vs gold (not in the published study)",
                              published="—", ours=structured_comparison(quality)))
        return out
    out.append(Comparison(finding="quality", published=PUBLISHED["quality"],
                          ours=quality_line(rows) + quality_test_line(tests or [])))
    return out


def quality_line(rows: list[StudyRow]) -> str:
    """What the study's own replies say about quality: same answers as the baseline (T=0), JSON validity
    and exact match against the gold answers, speculative vs baseline."""
    ok = [r for r in rows if r.ok]
    spec = [r for r in ok if r.speculative]
    if not spec or all(r.json_valid is None for r in ok):
        return "not measured (replies were not recorded)"
    parts = []
    agree = [r.agreement_vs_baseline for r in spec if r.agreement_vs_baseline is not None]
    if agree:
        parts.append(f"T=0: {min(agree):.0%}–{max(agree):.0%} of replies identical to the baseline's, per point")
    for temp in sorted({r.temperature for r in ok}):
        for what, key in (("JSON-valid", "json_valid"), ("exact match", "exact_match")):
            b = [getattr(r, key) for r in ok if not r.speculative and r.temperature == temp
                 and getattr(r, key) is not None]
            sp = [getattr(r, key) for r in spec if r.temperature == temp and getattr(r, key) is not None]
            if b and sp:
                parts.append(f"T={temp:g} {what}: speculative {_rng(sp, '{:.0%}')} vs baseline {_rng(b, '{:.0%}')}")
    return "; ".join(parts)


def quality_test_line(tests: list[QualityTest]) -> str:
    """The paired tests in a sentence: how many comparisons held, and the widest interval."""
    if not tests:
        return ""
    verdicts = [t.verdict for t in tests]
    worst = min(tests, key=lambda t: t.diff_ci95[0])
    return (f"; paired test of exact match vs the baseline (margin {worst.margin:.0%}): "
            f"{verdicts.count('preserved')} of {len(tests)} deployment×T preserved, "
            f"{verdicts.count('inconclusive')} inconclusive, {verdicts.count('worse')} worse; lowest interval "
            f"{worst.deployment} T={worst.temperature:g} Δ {worst.diff:+.1%} "
            f"[{worst.diff_ci95[0]:+.1%}, {worst.diff_ci95[1]:+.1%}], p={worst.mcnemar_p:.2g}")


# --- adaptive deployments -----------------------------------------------------------------------------


def adaptive_table(rows: list[StudyRow], results: list[PointResult]) -> list[AdaptiveRow]:
    """Each adaptive (γ per batch size) point beside the best fixed deployment at the same load and T.

    The goal of tuning: at every load at least 0.95 × the best fixed deployment measured (speculative or
    not) and at least 1.0 × the baseline; ``meets`` says whether this point does. Points measured in
    rounds carry 95% intervals of both ratios from their slices, and a missed goal whose intervals both
    reach it is ``within_noise``: the best fixed deployment is the largest of several noisy figures, and
    where the schedule decodes plainly the adaptive server is a baseline, so a point estimate alone
    misses about half the time. Beside it, the adaptive point over the fixed deployment that runs the same
    γ (``vs_same_gamma``): where the schedule's choice equals a fixed row's, that ratio is the noise
    between two servers doing the same work, the yardstick for reading the others."""
    schedules = {r.config.deployment: (r.config.spec.get("speculative") or {}).get("schedule")
                 for r in results if r.config.spec.get("speculative", {}).get("adaptive")}
    by_key = {r.key: r for r in results}
    ok = [r for r in rows if r.ok and r.output_throughput]
    out = []
    for a in ok:
        if a.deployment not in schedules:
            continue
        same = [r for r in ok if r.deployment not in schedules and r.temperature == a.temperature
                and r.mode == a.mode and r.concurrency == a.concurrency and r.rate == a.rate
                and r.request_set == a.request_set]
        if not same:
            continue
        best = max(same, key=lambda r: r.output_throughput)
        base = next((r for r in same if not r.speculative), None)
        vs_best = a.output_throughput / best.output_throughput
        vs_base = a.output_throughput / base.output_throughput if base else None
        best_ci = slice_ratio_ci(by_key[a.key], by_key[best.key])
        base_ci = slice_ratio_ci(by_key[a.key], by_key[base.key]) if base else None
        meets = vs_best >= 0.95 and (vs_base is None or vs_base >= 1.0)
        within = None
        if not meets and best_ci is not None and (base is None or base_ci is not None):
            within = best_ci[1] >= 0.95 and (base_ci is None or base_ci[1] >= 1.0)
        sched = schedules[a.deployment] or []
        gamma = schedule_gamma([tuple(s) for s in sched], a.concurrency or 1) if sched else None
        twin = None if gamma is None else base if gamma == 0 else next(
            (r for r in same if r.speculative and r.method == a.method and r.head == a.head and r.gamma == gamma),
            None)
        out.append(AdaptiveRow(deployment=a.deployment, temperature=a.temperature, concurrency=a.concurrency,
                               gamma_at_load=gamma, output_throughput=a.output_throughput,
                               best_fixed=best.deployment, best_fixed_throughput=best.output_throughput,
                               vs_best_fixed=vs_best, vs_baseline=vs_base, vs_best_fixed_ci95=best_ci,
                               vs_baseline_ci95=base_ci, meets=meets, within_noise=within, schedule=sched,
                               same_gamma=twin.deployment if twin else None,
                               vs_same_gamma=a.output_throughput / twin.output_throughput if twin else None,
                               vs_same_gamma_ci95=slice_ratio_ci(by_key[a.key], by_key[twin.key]) if twin else None))
    return sorted(out, key=lambda r: (r.deployment, r.temperature, r.concurrency or 0))


# --- verdict ------------------------------------------------------------------------------------------


def verdict(rows: list[StudyRow], caps: list[CapacityRow], slo: float, tests: list[QualityTest] | None = None) -> str:
    """A few sentences, one per temperature: speculation can pay greedily and lose when sampling."""
    ok = [r for r in rows if r.ok]
    failed = sorted({r.deployment for r in rows if r.status == "failed"} - {r.deployment for r in ok})
    tail = f" Failed deployments: {', '.join(failed)} (reasons in the report)." if failed else ""
    if not any(not r.speculative for r in ok):
        return "No baseline point was measured, so there is no speedup to report." + tail
    spec = [r for r in ok if r.speculative and r.speedup]
    if not spec:
        only = ", ".join(sorted({r.deployment for r in ok}))
        return f"Only {only} was measured: no speculative deployment ran to compare against." + tail

    def geo(pts: list[StudyRow]) -> float:
        return math.exp(sum(math.log(p.speedup) for p in pts) / len(pts))

    def load(p: StudyRow) -> str:
        return f"{'c' if p.mode == 'closed' else 'rate '}{p.concurrency or p.rate:g}"

    parts = []
    for temp in sorted({r.temperature for r in spec}):
        at = [r for r in spec if r.temperature == temp]
        by_dep: dict[str, list[StudyRow]] = {}
        for r in at:
            by_dep.setdefault(r.deployment, []).append(r)
        best = max(by_dep, key=lambda d: geo(by_dep[d]))
        pts = sorted(by_dep[best], key=lambda p: p.concurrency or p.rate or 0)
        wins = [p for p in pts if p.speedup > 1.0]
        acc = [p.acceptance_rate for p in pts if p.acceptance_rate is not None]
        s = (f"T={temp:g}: best is {best}, output throughput ×{geo(pts):.2f} of the baseline (geometric mean; "
             + ", ".join(f"{load(p)} ×{p.speedup:.2f}" for p in pts) + ")")
        if acc:
            s += f", acceptance {sum(acc) / len(acc):.1%}"
        if not wins:
            s += "; slower than the baseline at every load measured"
        elif len(wins) < len(pts):
            s += f"; it pays at {', '.join(load(p) for p in wins)} and loses at the other loads"
        else:
            s += "; faster at every load measured"
        others = [d for d in by_dep if d != best]
        if others:
            s += " (others: " + "; ".join(f"{d} ×{geo(by_dep[d]):.2f}" for d in others) + ")"
        base_cap = max((c.capacity_rps for c in caps if c.method == "none" and c.temperature == temp), default=0.0)
        best_cap = max((c.capacity_rps for c in caps if c.deployment == best and c.temperature == temp),
                       default=0.0)
        if base_cap > 0:
            s += (f". Under the {slo:g} s E2EL SLO one instance serves {base_cap:.2f} req/s without speculation "
                  f"and {best_cap:.2f} with {best} (×{best_cap / base_cap:.2f})")
        parts.append(s + ".")
    return " ".join(parts) + quality_alarm(ok, tests=tests) + tail


def quality_alarm(ok: list[StudyRow], margin: float = 0.05, tests: list[QualityTest] | None = None) -> str:
    """A sentence when a speculative point answers worse than the baseline at the same load and T, or a
    deployment's paired test says its exact match is worse."""
    base = {(r.concurrency, r.rate, r.temperature, r.request_set): r for r in ok if not r.speculative}
    bad = []
    for r in ok:
        b = base.get((r.concurrency, r.rate, r.temperature, r.request_set))
        if not r.speculative or not b or r.json_valid is None or b.json_valid is None:
            continue
        if r.json_valid < b.json_valid - margin:
            bad.append(f"{r.deployment} at T={r.temperature:g} ({r.json_valid:.0%} JSON-valid vs "
                       f"{b.json_valid:.0%})")
    for t in tests or []:
        if t.verdict == "worse":
            bad.append(f"{t.deployment} at T={t.temperature:g} (exact match {t.diff:+.1%} vs the baseline, "
                       f"95% CI [{t.diff_ci95[0]:+.1%}, {t.diff_ci95[1]:+.1%}])")
    return (" QUALITY ALARM: replies got worse with speculation: " + "; ".join(bad) + ".") if bad else ""


# --- the cost model -----------------------------------------------------------------------------------


def cost_model_section(results: list[PointResult]) -> CostModelFit | CostModelMissing:
    """The machine's fitted step costs and how well they predict this run's points.
    A run the model cannot be fitted on gets the reason instead, and the rest of the analysis is unaffected."""
    from .cost_model import fit_cost_model

    try:
        model = fit_cost_model(results)
        preds = model.evaluate(results)
    except ValueError as exc:
        return CostModelMissing(reason=str(exc))
    return CostModelFit(coefficients=model.coefficients, n_points=model.n_points,
                            median_abs_error=model.median_abs_error,
                            loo_median_abs_error=model.loo_median_abs_error, machine=model.machine, points=preds)


# --- the whole analysis -------------------------------------------------------------------------------


def analyse(results: list[PointResult], manifest: RunManifest | None = None, run_dir: str | Path = "",
            quality: QualityReport | None = None, target_rps: float | None = None,
            slo: float | None = None) -> StudyAnalysis:
    """The analysis of a run's points. ``quality``: ``cartspec quality``'s report (quality.json), if it ran."""
    from .classes import acceptance_by_class

    manifest = manifest or RunManifest()
    if slo is None:
        slo = next((r.config.slo_e2el_s for r in results), 2.0)
    rows = study_rows(results)
    caps, target = capacity_table(rows, target_rps)
    tests = quality_tests(results)
    comparison = published_comparison(rows, caps, tests, quality)
    text = verdict(rows, caps, slo, tests)
    if quality and quality.entries:
        from ..quality.report import quality_sentence

        text += quality_sentence(quality)
    machine = manifest.machine or next((r.machine for r in results if r.machine), {})
    versions = next((r.deployment.versions for r in results if r.deployment and r.deployment.versions), {})
    judge = None
    if quality and (quality.judge or quality.calibrations):
        judge = QualityJudge(judge=quality.judge, calibrations=quality.calibrations, metric=quality.metric,
                             margin=quality.margin)
    return StudyAnalysis(
        run=RunInfo(dir=str(run_dir), preset=manifest.preset, machine=machine, engine=versions,
                    invocations=manifest.invocations,
                    dtypes=sorted({r.dtype for r in rows if r.dtype}), seconds=manifest.seconds,
                    interleave=int(manifest.plan.get("interleave") or 1),
                    rounds=int(manifest.plan.get("rounds") or 1),
                    restart_rounds=bool(manifest.plan.get("restart_rounds"))),
        slo_e2el_s=slo, target_rps=target, points=rows, capacity=caps, quality_tests=tests,
        published_comparison=comparison, verdict=text, quality=quality.entries if quality else [],
        quality_judge=judge, quality_metric=quality.metric if quality else None,
        quality_margin=quality.margin if quality else None, cost_model=cost_model_section(results),
        adaptive=adaptive_table(rows, results), acceptance_by_class=acceptance_by_class(results))


def analyse_run(run_dir: str | Path, target_rps: float | None = None, slo: float | None = None) -> StudyAnalysis:
    """A run directory's ``results.jsonl`` (+ ``run.json``, ``quality.json``), analysed."""
    from ..quality.study import load_quality

    run_dir = Path(run_dir)
    return analyse(load_results(run_dir), RunManifest.load(run_dir), run_dir, load_quality(run_dir),
                   target_rps=target_rps, slo=slo)
