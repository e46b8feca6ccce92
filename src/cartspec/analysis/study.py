"""A study run, analysed: ``results.jsonl`` (+ ``run.json``, ``quality.json``) -> a typed ``StudyAnalysis``.

Every figure the report shows is computed from the results file (``rows``, ``capacity``, ``adaptive``, ``pairs``, the
cost model, the classes), so ``cartspec report --run DIR`` rebuilds the same analysis at any time; the
sentences that state them are the report's (``report/prose.py``). Speedups are ratios of points measured in
the same run on the same machine: absolute times on shared machines drift, ratios hold.
"""

from __future__ import annotations

from pathlib import Path

from ..quality.models import QualityReport
from ..results import PointResult, RunManifest, load_results, patch_summary
from .adaptive import adaptive_table
from .pairs import pair_table
from .capacity import capacity_table
from .models import CostModelFit, CostModelMissing, QualityJudge, RunInfo, StudyAnalysis
from .rows import quality_tests, study_rows


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
                    restart_rounds=bool(manifest.plan.get("restart_rounds")),
                    vllm_patches=patch_summary(results) or None),
        slo_e2el_s=slo, target_rps=target, points=rows, capacity=caps, quality_tests=tests,
        quality=quality.entries if quality else [],
        quality_judge=judge, quality_metric=quality.metric if quality else None,
        quality_margin=quality.margin if quality else None, cost_model=cost_model_section(results),
        adaptive=adaptive_table(rows, results), hybrid_pairs=pair_table(rows, results) or None,
        acceptance_by_class=acceptance_by_class(results))


def analyse_run(run_dir: str | Path, target_rps: float | None = None, slo: float | None = None) -> StudyAnalysis:
    """A run directory's ``results.jsonl`` (+ ``run.json``, ``quality.json``), analysed."""
    from ..quality.study import load_quality

    run_dir = Path(run_dir)
    return analyse(load_results(run_dir), RunManifest.load(run_dir), run_dir, load_quality(run_dir),
                   target_rps=target_rps, slo=slo)
