"""The adaptive points (γ per batch size, or a draft cut per request) beside the fixed deployments measured at the
same load."""

from __future__ import annotations

from ..results import PointResult
from ..serving.spec import schedule_gamma
from .models import AdaptiveRow, StudyRow
from .rows import slice_ratio_ci
from .specs import measured_spec


def adaptive_table(rows: list[StudyRow], results: list[PointResult]) -> list[AdaptiveRow]:
    """Each adaptive point beside the best fixed deployment at the same load and T: a schedule (γ per batch
    size) or a draft cut per request (``speculative.draft_stop``), which needs no schedule.

    The goal of both: at every load at least 0.95 × the best fixed deployment measured (speculative or
    not) and at least 1.0 × the baseline; ``meets`` says whether this point does. Points measured in
    rounds carry 95% intervals of both ratios from their slices, and a missed goal whose intervals both
    reach it is ``within_noise``: the best fixed deployment is the largest of several noisy figures, and
    where the schedule decodes plainly the adaptive server is a baseline, so a point estimate alone
    misses about half the time. Beside it, the adaptive point over the fixed deployment that runs the same
    γ (``vs_same_gamma``): where the schedule's choice equals a fixed row's, that ratio is the noise
    between two servers doing the same work, the yardstick for reading the others."""
    specs = {r.config.deployment: measured_spec(r.config) for r in results}
    schedules = {d: s.speculative.schedule for d, s in specs.items() if s and s.speculative.adaptive}
    # a draft cut per request (its threshold): adaptive too, and held to the same goal
    cuts = {d: s.speculative.draft_stop for d, s in specs.items()
            if s and s.speculative.draft_stop and d not in schedules}
    by_key = {r.key: r for r in results}
    ok = [r for r in rows if r.ok and r.output_throughput]
    out = []
    for a in ok:
        if a.deployment not in schedules and a.deployment not in cuts:
            continue
        same = [r for r in ok if r.deployment not in schedules and r.deployment not in cuts and r.point == a.point]
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
        sched = schedules.get(a.deployment) or []
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
                               vs_same_gamma_ci95=slice_ratio_ci(by_key[a.key], by_key[twin.key]) if twin else None,
                               draft_stop=cuts.get(a.deployment)))
    return sorted(out, key=lambda r: (r.deployment, r.temperature, r.concurrency or 0))
