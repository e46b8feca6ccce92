"""``cartspec quality``: a study's stored replies, tested and judged against the baseline's (no re-measurement).

Per speculative deployment and temperature, every reply is paired with the baseline's to the same request
and sample index (``RequestRecord.id`` and ``.sample``) at the same load, request set and settings, and
scored against the request's gold answer; ``quality/paired.py`` makes the tests and the verdict, and
``quality/judge.py`` the optional pairwise judge with its calibration. The result goes to ``quality.json``
in the run directory; the analysis reads it from there into ``summary.json`` (``quality``) and the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ..results import PointResult, baseline_for, baselines, load_results, matched_records, now_iso
from ..task.request_sets import load_request_set
from .models import QUALITY_FILE, Pair, QualityEntry, QualityReport
from .paired import METRICS, field_deltas, metric_values, paired_test

if TYPE_CHECKING:
    from .judge import JudgeSetup


class QualityError(ValueError):
    """A run that cannot be tested: missing, empty, without a baseline, or without stored replies."""


# --- pairing ---------------------------------------------------------------------------


def gold_requests(results: Iterable[PointResult]) -> dict[tuple[str, str], Any]:
    """(request set, id) -> the task request with its gold answer, regenerated as the sweep generated it."""
    need: dict[str, int] = {}
    for r in results:
        c = r.config
        need[c.request_set] = max(need.get(c.request_set, 0), c.n_requests + c.warmup)
    out: dict[tuple[str, str], Any] = {}
    for rs, n in need.items():
        try:
            reqs = load_request_set(rs, n)
        except Exception as exc:
            raise QualityError(f"cannot rebuild request set {rs!r} to score its replies: {exc}") from exc
        for req in reqs:
            if req.id:
                out[(rs, req.id)] = req
    return out


def collect_pairs(results: list[PointResult]) -> dict[tuple[str, float, str], list[Pair]]:
    """(deployment, temperature, request set) -> its pairs with the baseline, over every load."""
    base = baselines(results)
    out: dict[tuple[str, float, str], list[Pair]] = {}
    for r in results:
        b = baseline_for(base, r.config)
        if r.status != "ok" or r.config.method == "none" or b is None:
            continue
        key = (r.config.deployment, r.config.temperature, r.config.request_set)
        out.setdefault(key, []).extend(
            Pair(request_id=x.id, sample=x.sample, load=r.config.load, baseline=y.text, candidate=x.text)
            for y, x in matched_records(b, r))
    return out


def structured_entry(dep: str, temp: float, rs: str, pairs: list[Pair], gold: dict, metric: str,
                     margin: float) -> QualityEntry | None:
    from ..task.score import score_item

    scored = []
    for p in pairs:
        req = gold.get((rs, p.request_id))
        if req is None:
            continue
        scored.append((p, score_item(req, p.baseline), score_item(req, p.candidate)))
    if not scored:
        return None
    tests = []
    for m in METRICS:
        rows = [(p, metric_values(a)[m], metric_values(b)[m]) for p, a, b in scored]
        rows = [x for x in rows if x[1] is not None and x[2] is not None]
        if rows:
            tests.append(paired_test(m, [p.request_id for p, _, _ in rows], [x[1] for x in rows],
                                     [x[2] for x in rows], margin=margin, samples=[p.sample for p, _, _ in rows],
                                     sampled=temp > 0))
    main = next((t for t in tests if t.metric == metric), None)
    if main is None:
        raise QualityError(f"metric {metric!r} cannot be computed for {dep} (no gold answers?)")
    return QualityEntry(deployment=dep, temperature=temp, request_set=rs, metric=metric, n=main.requests,
                        pairs=main.pairs, samples=main.samples, verdict=main.verdict, diff=main.diff,
                        identical=sum(p.baseline == p.candidate for p, _, _ in scored) / len(scored),
                        ci_low=main.ci_low, ci_high=main.ci_high, margin=margin, needed_n=main.needed_n,
                        needed_samples=main.needed_samples, tests=tests,
                        fields=field_deltas([(a, b) for _, a, b in scored]))


def structured_quality(results: list[PointResult], metric: str = "exact_match",
                       margin: float = 0.02) -> tuple[list[QualityEntry], dict[tuple[str, float, str], list[Pair]]]:
    if metric not in METRICS:
        raise QualityError(f"unknown metric {metric!r}: {', '.join(METRICS)}")
    ok = [r for r in results if r.status == "ok"]
    if not ok:
        raise QualityError("the run has no successfully measured point")
    if not any(r.config.method == "none" for r in ok):
        raise QualityError("the run has no baseline point (deployment 'baseline'): nothing to compare against")
    if not any(x.text is not None for r in ok for x in r.records):
        raise QualityError("the run's results hold no reply texts (measured before replies were recorded)")
    pairs = collect_pairs(results)
    if not pairs:
        raise QualityError("no speculative point shares a load, temperature and request set with a baseline point")
    gold = gold_requests(ok)
    entries = []
    for (dep, temp, rs), ps in sorted(pairs.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        e = structured_entry(dep, temp, rs, ps, gold, metric, margin)
        if e is not None:
            entries.append(e)
    return entries, pairs


# --- the run ---------------------------------------------------------------------------------


def load_quality(run_dir: str | Path) -> QualityReport | None:
    path = Path(run_dir) / QUALITY_FILE
    if not path.exists():
        return None
    try:
        return QualityReport.model_validate_json(path.read_text())
    except ValueError:
        return None


def quality_for_run(run_dir: str | Path, *, metric: str = "exact_match", margin: float = 0.02,
                    judge: "JudgeSetup | None" = None, log=print) -> QualityReport:
    """Test (and with ``judge``, judge) a run's stored replies; writes ``quality.json``. The report is the
    caller's to rebuild (``report.build.build_report``): this stage never starts the one after it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise QualityError(f"run directory not found: {run_dir}")
    if not (run_dir / "results.jsonl").exists():
        raise QualityError(f"no results.jsonl in {run_dir}: not a study's run directory")
    results = load_results(run_dir)
    entries, pairs = structured_quality(results, metric, margin)
    prev = load_quality(run_dir)
    report = QualityReport(created_at=now_iso(), margin=margin, metric=metric, entries=entries,
                           calibrations=dict(prev.calibrations) if prev else {})
    if judge is not None:
        from .judge import run_judge

        gold = gold_requests([r for r in results if r.status == "ok"])
        run_judge(judge, report, pairs, gold, run_dir, log=log)
    (run_dir / QUALITY_FILE).write_text(report.model_dump_json(indent=2))
    return report

