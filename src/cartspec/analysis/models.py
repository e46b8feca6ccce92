"""The study's analysis as types: ``StudyAnalysis`` and its rows. ``summary.json`` is
``StudyAnalysis.model_dump(mode="json")`` and loads back with ``StudyAnalysis.load``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from ..config_files import omit_when_none

from ..quality.models import JudgeCalibration, QualityEntry, QualityReport
from ..results import Invocation, Machine, load_label, load_value
from .classes import ClassAcceptance
from .cost_model import PointPrediction, StepCosts

# a row's figures from its point's engine steps (``vllm_plugin.steps.summary``), left out where it has none
STEP_FIELDS = ("draft_ms", "verify_ms", "prefill_share", "decode_ms", "prefill_time_share", "fixed_time_share")

SUMMARY_FILE = "summary.json"

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
    draft_ms: float | None = Field(None, description="the engine's drafting per step (ms), over the point's steps")
    verify_ms: float | None = Field(None, description="the rest of an engine step (ms): the target's forward, "
                                    "sampling and verification")
    prefill_share: float | None = Field(None, description="of the tokens the target ran, the prompts' prefill: "
                                        "work that speculation does not shorten")
    decode_ms: float | None = Field(None, description="an engine step that prefilled no prompt (ms): the cost "
                                    "of a step of decoding alone, which τ divides")
    prefill_time_share: float | None = Field(None, description="of the engine steps' time, the steps that "
                                             "prefilled a prompt")
    fixed_time_share: float | None = Field(None, description="of the engine steps' time, the part no τ can "
                                           "shorten: each prefilling step's time above a decoding step's, and "
                                           "a request's first step shared by the batch (vllm_plugin.steps)")
    draft_headroom: float | None = Field(None, description="points drafting γ tokens a step "
                                         "(analysis.rows.full_drafts): the speed-up over the point a draft "
                                         "accepted in full (τ = γ + 1) would give with equal step costs, the fixed "
                                         "share as it was: the most a better draft at this γ can add")
    _without_unknown_steps = omit_when_none(*STEP_FIELDS, "draft_headroom")  # points without step counts

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

    @property
    def point(self) -> tuple:
        """Where the row was measured: temperature, load and request set; rows of several deployments with
        the same ``point`` were measured alike and compare."""
        return (self.temperature, self.mode, self.concurrency, self.rate, self.request_set)


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
    """An adaptive point (γ per batch size, or a draft cut per request) beside the best fixed deployment at the
    same load and T."""

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
    draft_stop: float | None = Field(None, description="a draft cut per request: the threshold on the head's path "
                                                       "probability (no schedule; γ is the longest draft)")


class PairRow(BaseModel):
    """A hybrid point beside the head alone at the same γ and load: its τ gain and the speed it kept
    (``analysis.pairs``)."""

    deployment: str
    head_deployment: str
    temperature: float
    mode: Literal["closed", "open"] = "closed"
    concurrency: int | None = None
    rate: float | None = None
    request_set: str = "commerce"
    gamma: int | None = None
    tau: float
    head_tau: float
    tau_ratio: float
    ratio: float = Field(..., description="output throughput over the head alone's")
    ratio_ci95: tuple[float, float] | None = Field(None, description="95% interval from the slices (rounds only)")
    goal: float = Field(..., description="1 + 0.8 × (tau_ratio − 1)")
    meets_goal: bool
    fixed_time_share: float | None = Field(None, description="the head point's share of step time that no τ can "
                                                             "shorten (StudyRow.fixed_time_share)")
    attainable: float | None = Field(None, description="the ratio with equal step costs: 1 / ((1 − s) / r + s), "
                                                       "s the fixed share")
    kept: float | None = Field(None, description="(ratio − 1) / (attainable − 1)")
    goal_attainable: bool | None = Field(None, description="goal ≤ attainable: whether any drafter with this τ "
                                                           "could meet the goal at this fixed share")
    draft_ms: float | None = None
    head_draft_ms: float | None = None
    decode_ms: float | None = None
    head_decode_ms: float | None = None

    @property
    def load(self) -> str:
        return load_label(self.mode, self.concurrency, self.rate)


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
    vllm_patches: dict[str, str] | None = Field(None, description=(
        "each patch of cartspec's vLLM plugin -> what the deployments' logs reported: applied, skipped, "
        "failed, or e.g. 'skipped in 2 of 3 deployments, applied in 1 of 3 deployments'; absent where the "
        "deployments reported none (runs before the plugin, servers cartspec did not start)"))

    _without_absent_patches = omit_when_none("vllm_patches")  # a run without the report: the summary as before


class StudyAnalysis(BaseModel):
    """The whole analysis of a study run; ``summary.json`` is its JSON dump."""

    run: RunInfo
    slo_e2el_s: float
    target_rps: float | None = None
    points: list[StudyRow] = Field(default_factory=list)
    capacity: list[CapacityRow] = Field(default_factory=list)
    quality_tests: list[QualityTest] = Field(default_factory=list)
    published_comparison: list[Comparison] = Field(default_factory=list, description="the report's rows "
                                                   "(report/prose.py), filled when the report is built")
    verdict: str = Field("", description="the report's sentences (report/prose.py), filled when it is built")
    quality: list[QualityEntry] = Field(default_factory=list, description="`cartspec quality`'s entries")
    quality_judge: QualityJudge | None = None
    quality_metric: str | None = Field(None, description="the metric `cartspec quality` rests its verdicts on")
    quality_margin: float | None = None
    definitions: dict[str, str] = Field(default_factory=lambda: dict(DEFINITIONS))
    cost_model: CostModelSection = Field(default_factory=lambda: CostModelMissing(reason="no points"))
    adaptive: list[AdaptiveRow] = Field(default_factory=list)
    hybrid_pairs: list[PairRow] | None = Field(None, description="each hybrid point beside the head alone at "
                                               "the same γ and load: its τ gain and the speed it kept; absent "
                                               "where the run has no such pair")
    acceptance_by_class: list[ClassAcceptance] = Field(default_factory=list)

    _without_absent_pairs = omit_when_none("hybrid_pairs")  # a run without hybrids: the summary as before

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
