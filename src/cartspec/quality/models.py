"""The quality step's types: what ``cartspec quality`` writes to ``quality.json`` and the analysis reads back.

``QualityReport`` is the whole file; its entries (one per speculative deployment, temperature and request
set) carry the paired tests (``paired.PairedTest``, ``paired.FieldDelta``) and the judge's outcome.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from .paired import TEST_NAME, FieldDelta, PairedTest

QUALITY_FILE = "quality.json"


class JudgeCalibration(BaseModel):
    """How far the judge can be trusted: its answers on pairs whose right answer is known."""

    mode: str
    n: int = Field(..., description="known-answer pairs (corrupted + identical)")
    accuracy: float = Field(..., description="share judged right: gold over its corrupted copy, identical = tie")
    position_consistency: float = Field(..., description="share whose two orders named the same winner (or tie)")
    tie_rate: float = Field(..., description="share of the corrupted pairs judged a tie (each a miss)")
    reliable: bool = Field(..., description="accuracy >= 80%: below it the verdict rests on the structured tests")
    by_kind: dict[str, float] = Field(default_factory=dict, description="accuracy per corruption kind")


class JudgeResult(BaseModel):
    """The candidate against the baseline, judged pairwise in both orders (inconsistent orders: a tie)."""

    model: str
    mode: str
    win: int
    tie: int
    loss: int
    judged: int = Field(..., description="pairs sent to the judge (identical replies are ties without asking)")
    pairs: int = Field(..., description="distinct (request, sample) pairs available")
    p_value: float = Field(..., description="exact sign test, wins vs losses")
    by_task: dict[str, dict[str, int]] = Field(default_factory=dict, description="search / support: win, tie, loss")
    calibration: JudgeCalibration | None = None


class QualityEntry(BaseModel):
    deployment: str
    temperature: float
    request_set: str = "commerce"
    metric: str = Field(..., description="the metric the verdict rests on")
    n: int = Field(..., description="paired requests (clusters) behind the verdict")
    pairs: int = Field(..., description="paired replies (request × sample × load)")
    samples: int = 1
    identical: float = Field(0.0, description="share of pairs whose replies are the same text")
    verdict: str
    diff: float
    ci_low: float
    ci_high: float
    margin: float
    needed_n: int | None = None
    needed_samples: int | None = None
    test: str = TEST_NAME
    tests: list[PairedTest] = Field(default_factory=list, description="every metric, the verdict's among them")
    fields: list[FieldDelta] = Field(default_factory=list)
    judge: JudgeResult | None = None

    def test_of(self, metric: str) -> PairedTest | None:
        """The paired test of ``metric`` among this entry's, if it was computed."""
        return next((t for t in self.tests if t.metric == metric), None)


class QualityReport(BaseModel):
    created_at: str = ""
    margin: float = 0.02
    metric: str = "exact_match"
    entries: list[QualityEntry] = Field(default_factory=list)
    calibrations: dict[str, JudgeCalibration] = Field(default_factory=dict,
                                                      description="per judge mode, the latest calibration")
    judge: dict[str, Any] | None = Field(None, description="which judge ran (model, url, mode); never a key")


class Pair(BaseModel):
    """One request (sample) answered by both deployments at one point."""

    request_id: str
    sample: int
    load: str
    baseline: str
    candidate: str
