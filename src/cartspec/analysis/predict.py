"""What a drafter's τ would buy on a machine a study measured, before it is served.

A study's point of a speculative deployment gives the deployment's output throughput there, its τ and the
share ``s`` of its engine time that no τ shortens (``StudyRow.fixed_time_share``: what the prompts add to
their steps, and each request's first step). A candidate drafter at the same γ whose τ was measured by
``cartspec draft acceptance`` would, with the deployment's step costs, run that point at

    predicted = throughput × attainable(r, s),        r = τ_candidate / τ_reference

(``analysis.rows.attainable``: the τ ratio divides the share of the time that τ shortens, the fixed share
stays). τ_reference is, where given, a report of the deployment's own drafter measured on the candidate's
requests (the ratio is then paired, request set for request set), else each point's own τ (the study's
requests, which need not be the candidate's: the command says so).

It is a bound, not a measurement: a drafter whose own work costs more per step than the deployment's (the
hybrid's rules beside its head) runs below it, and a study's point moves by several percent from run to run
on a shared machine. The acceptance command measures at temperature 0, so only T=0 points are predicted.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from ..config_files import FileModel
from ..results_acceptance import AcceptanceReport
from .models import StudyRow
from .rows import attainable

DRAFTERS = ("eagle3", "hybrid")  # the methods whose τ a head's acceptance report measures


class PredictError(ValueError):
    """The inputs cannot be read together; the message says what to give instead."""


class PredictedPoint(BaseModel):
    """One T=0 point of the deployment, and what the candidate's τ would make of it."""

    mode: str
    concurrency: int | None = None
    rate: float | None = None
    request_set: str
    throughput: float = Field(..., description="the deployment's output tok/s at the point")
    tau: float = Field(..., description="the deployment's τ at the point")
    fixed_time_share: float = Field(..., description="of the point's engine time, the part no τ shortens")
    tau_ratio: float = Field(..., description="τ candidate ÷ τ reference")
    ratio: float = Field(..., description="attainable(tau_ratio, fixed_time_share): predicted ÷ measured")
    predicted_throughput: float
    speedup: float | None = Field(None, description="the deployment's speedup over the baseline at the point")
    predicted_speedup: float | None = None


class Prediction(FileModel):
    """What ``cartspec draft predict`` writes (``--out``)."""

    run: str
    deployment: str
    gamma: int
    candidate: str
    candidate_tau: float
    reference: str | None = Field(None, description="the reference report; None: each point's own τ")
    reference_tau: float | None = None
    points: list[PredictedPoint] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list, description="T=0 points left out, and why")
    note: str = ("a bound, with the deployment's step costs: a drafter whose own work costs more per step runs "
                 "below it")


def pick_deployment(rows: list[StudyRow], gamma: int, method: str | None, head: str | None,
                    deployment: str | None = None) -> str:
    """The run's deployment the candidate is read against: ``deployment`` where given (it must be a drafter at
    ``gamma``), else the one at ``gamma`` with the candidate's method, then with its head, then EAGLE-3."""
    drafters = sorted({(r.deployment, r.method, r.head) for r in rows if r.method in DRAFTERS and r.gamma == gamma})
    if deployment is not None:
        all_deps = sorted({r.deployment for r in rows})
        if deployment not in all_deps:
            raise PredictError(f"the run has no deployment {deployment!r}; it has: {', '.join(all_deps)}")
        if deployment not in {d for d, _, _ in drafters}:
            raise PredictError(f"{deployment!r} is not an EAGLE-3 or hybrid deployment at γ={gamma} (the "
                               "candidate's γ): a τ at one γ says nothing of another")
        return deployment
    if not drafters:
        raise PredictError(f"the run has no EAGLE-3 or hybrid deployment at γ={gamma} (the candidate's γ): "
                           "measure the candidate at a γ the study ran, or give --deployment")
    for keep in (lambda m, h: m == method and h == head, lambda m, h: m == method, lambda m, h: m == "eagle3"):
        found = [d for d, m, h in drafters if keep(m, h)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise PredictError(f"several deployments fit ({', '.join(found)}): give --deployment")
    raise PredictError(f"several deployments fit ({', '.join(d for d, _, _ in drafters)}): give --deployment")


def _check_reference(candidate: AcceptanceReport, reference: AcceptanceReport) -> None:
    if reference.gamma != candidate.gamma:
        raise PredictError(f"the reference was measured at γ={reference.gamma}, the candidate at "
                           f"γ={candidate.gamma}: measure both at the same γ")
    if (reference.data, reference.n) != (candidate.data, candidate.n):
        raise PredictError(f"the reference was measured on {reference.data} (n={reference.n}), the candidate on "
                           f"{candidate.data} (n={candidate.n}): measure both on the same requests")
    if not reference.tau:
        raise PredictError("the reference report has no τ (no step metrics): measure it again")


def predict(rows: list[StudyRow], candidate: AcceptanceReport, reference: AcceptanceReport | None = None,
            deployment: str | None = None, run: str | Path = "", candidate_path: str | Path = "",
            reference_path: str | Path | None = None) -> Prediction:
    """The candidate's predicted throughput at each T=0 point of the deployment (module doc)."""
    if candidate.gamma is None or not candidate.tau:
        raise PredictError("the candidate report has no γ or no τ: give the JSON `cartspec draft acceptance "
                           "--out` wrote for an EAGLE-3 or hybrid drafter")
    if candidate.temperature not in (None, 0, 0.0):
        raise PredictError(f"the candidate was measured at T={candidate.temperature}; predictions read T=0 points")
    if reference is not None:
        _check_reference(candidate, reference)
    dep = pick_deployment(rows, candidate.gamma, candidate.method, candidate.head_name, deployment)
    pts = sorted((r for r in rows if r.deployment == dep and r.temperature == 0),
                 key=lambda r: (r.request_set, r.mode, r.concurrency or 0, r.rate or 0))
    if not pts:
        raise PredictError(f"{dep} has no point at T=0 in the run")
    out = Prediction(run=str(run), deployment=dep, gamma=candidate.gamma, candidate=str(candidate_path),
                     candidate_tau=candidate.tau, reference=None if reference is None else str(reference_path),
                     reference_tau=None if reference is None else reference.tau)
    for r in pts:
        where = f"{'c' if r.mode == 'closed' else 'rate '}{r.concurrency or r.rate:g} ({r.request_set})"
        if not r.ok or not r.output_throughput or not r.tau:
            out.skipped.append(f"{where}: the point did not run ({r.reason or r.status})")
            continue
        if r.fixed_time_share is None:
            out.skipped.append(f"{where}: no engine step counts with decoding times (a study of an older "
                               "version, or a server without cartspec's plugin): run the study again")
            continue
        ref = reference.tau if reference is not None else r.tau
        tau_ratio = candidate.tau / ref
        ratio = attainable(tau_ratio, r.fixed_time_share)
        out.points.append(PredictedPoint(
            mode=r.mode, concurrency=r.concurrency, rate=r.rate, request_set=r.request_set,
            throughput=r.output_throughput, tau=r.tau, fixed_time_share=r.fixed_time_share, tau_ratio=tau_ratio,
            ratio=ratio, predicted_throughput=r.output_throughput * ratio, speedup=r.speedup_vs_baseline,
            predicted_speedup=None if r.speedup_vs_baseline is None else r.speedup_vs_baseline * ratio))
    if not out.points:
        raise PredictError(f"none of {dep}'s T=0 points can be predicted: " + "; ".join(out.skipped))
    return out
