"""A study's points as rows beside their baselines, and the ratios between points with their intervals."""

from __future__ import annotations

import math
from typing import Sequence

from ..results import PointResult, baseline_for, baselines, matched_records
from ..vllm_plugin.steps import summary as step_summary
from .models import STEP_FIELDS, QualityTest, StudyRow
from ..serving.spec import DeploymentSpec
from .specs import measured_spec


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


def attainable(tau_ratio: float, fixed_time_share: float) -> float:
    """Throughput over a point's with τ multiplied by ``tau_ratio`` and equal step costs: the share of the time
    that τ shortens (a reply's decoding steps) divided by the ratio, the fixed share (``StudyRow.fixed_time_share``)
    as it was."""
    s = min(max(fixed_time_share, 0.0), 1.0)
    return 1.0 / ((1.0 - s) / tau_ratio + s)


def _step_figures(r: PointResult, spec: DeploymentSpec | None) -> dict:
    """The point's engine steps (patch ``step_stats``): drafting and verifying ms a step, the prompts' share
    of the tokens, a decoding step's ms and the share of the time in steps that prefilled; for a speculative
    point, what a draft accepted in full would add (``StudyRow.draft_headroom``)."""
    s = step_summary(r.engine_steps or {}) if r.status == "ok" else None
    if not s:
        return {}
    out = {f: s.get(f) for f in STEP_FIELDS}
    gamma, tau, fixed = r.config.gamma, r.tau, out.get("fixed_time_share")
    if full_drafts(r, spec) and gamma and tau and fixed is not None:
        out["draft_headroom"] = attainable((gamma + 1) / tau, fixed)
    return out


def full_drafts(r: PointResult, spec: DeploymentSpec | None) -> bool:
    """Whether every step of the point drafts γ tokens for each request (a head or a draft model at a fixed γ,
    with or without the hybrid's copies), so that its τ and its step costs say what a draft accepted in full
    would give. n-gram lookup and the schema drafter draft less, or nothing, where they find nothing; a
    schedule or a draft cut per request varies γ. ``spec``: the point's (``measured_spec``)."""
    sp = spec.speculative if spec is not None else None
    return (r.config.method in ("eagle3", "hybrid", "draft_model") and sp is not None and not sp.adaptive
            and not sp.schedule and sp.draft_stop is None)


def study_rows(results: list[PointResult]) -> list[StudyRow]:
    """One row per point, with the speedup over the baseline at the same load and temperature."""
    base = baselines(results)
    rows = []
    for r in sorted(results, key=lambda r: (r.config.deployment, r.config.request_set, r.config.temperature,
                                            r.config.load_value)):
        c = r.config
        spec = measured_spec(c)
        b = baseline_for(base, c)
        ok = r.status == "ok"
        speedup = (r.output_throughput / b.output_throughput
                   if ok and b and b.output_throughput and r.output_throughput is not None else None)
        lat = (r.e2el_p50 / b.e2el_p50 if ok and b and b.e2el_p50 and r.e2el_p50 is not None else None)
        agree = baseline_agreement(r, b) if ok and b and c.method != "none" else None
        rows.append(StudyRow(
            deployment=c.deployment, method=c.method, gamma=c.gamma, head=c.head, mode=c.mode,
            concurrency=c.concurrency, rate=c.rate, temperature=c.temperature, request_set=c.request_set,
            dtype=spec.dtype if spec else None, status=r.status, reason=r.reason,
            n_requests=r.n_requests, n_errors=r.n_errors, wall_s=r.wall_s,
            output_throughput=r.output_throughput, request_throughput=r.request_throughput,
            goodput=r.goodput, slo_attainment=r.slo_attainment,
            ttft_p50=r.ttft_p50, ttft_p99=r.ttft_p99, tpot_p50=r.tpot_p50, tpot_p99=r.tpot_p99,
            itl_p50=r.itl_p50, itl_p99=r.itl_p99, e2el_p50=r.e2el_p50, e2el_p90=r.e2el_p90, e2el_p99=r.e2el_p99,
            acceptance_rate=r.acceptance_rate, tau=r.tau,
            acceptance_per_position=r.acceptance.per_position_rate if r.acceptance else None,
            speedup_vs_baseline=speedup, e2el_p50_ratio_vs_baseline=lat,
            speedup_ci95=slice_ratio_ci(r, b) if speedup is not None and c.method != "none" else None,
            json_valid=r.json_valid, exact_match=r.exact_match, agreement_vs_baseline=agree, key=r.key,
            **_step_figures(r, spec)))
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
        b = baseline_for(base, r.config)
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
