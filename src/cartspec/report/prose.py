"""The report's sentences: the verdict, and this run beside the published study, from a ``StudyAnalysis``.

The analysis computes the figures; the words that state them live here, with the report. ``with_prose``
fills an analysis's ``verdict`` and ``published_comparison`` before the report saves and renders it.
"""

from __future__ import annotations

import math
from typing import Iterable

from ..analysis.models import CapacityRow, Comparison, QualityTest, StudyAnalysis, StudyRow
from ..quality.models import QualityReport
from .quality import judge_comparison, quality_sentence, structured_comparison

# The published study (PayPal Commerce Agent: llama3.1-nemotron-nano-8B + LoRA, EAGLE-3 on vLLM, 2xH100), for the side-by-side table.
PUBLISHED = {
    "gain_g3": "+22% to +49%",
    "latency_g3": "18% to 33% lower",
    "accept_g3": "about 35.5%, stable across conditions",
    "accept_g5": "about 25%; gains shrink, slower at high concurrency",
    "one_vs_two": "one GPU with speculation matches or beats two without",
    "quality": "preserved (LLM-as-judge, pairwise)",
}


def with_prose(analysis: StudyAnalysis) -> StudyAnalysis:
    """``analysis`` with its verdict and its rows beside the published study written out."""
    a = analysis
    quality = a.quality_report()
    text = verdict(a.points, a.capacity, a.slo_e2el_s, a.quality_tests)
    if quality and quality.entries:
        text += quality_sentence(quality)
    return a.model_copy(update={"verdict": text, "published_comparison": published_comparison(
        a.points, a.capacity, a.quality_tests, quality)})


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
    parity = parity_line(spec)
    if parity:
        parts.append(parity)
    for temp in sorted({r.temperature for r in ok}):
        for what, key in (("JSON-valid", "json_valid"), ("exact match", "exact_match")):
            b = [getattr(r, key) for r in ok if not r.speculative and r.temperature == temp
                 and getattr(r, key) is not None]
            sp = [getattr(r, key) for r in spec if r.temperature == temp and getattr(r, key) is not None]
            if b and sp:
                parts.append(f"T={temp:g} {what}: speculative {_rng(sp, '{:.0%}')} vs baseline {_rng(b, '{:.0%}')}")
    return "; ".join(parts)


def parity_line(rows: list[StudyRow]) -> str:
    """Greedy replies identical to the baseline's, per dtype and load (the lowest share over the speculative
    deployments at that load): batched verification sums in another order than one-token decoding, so in
    bfloat16 a near-tie can flip a token, more often the larger the batch. It is said beside the paired test,
    which is the quality verdict; identity alone is not."""
    by: dict[tuple[str, int | None], list[float]] = {}
    for r in rows:
        if r.agreement_vs_baseline is not None:
            by.setdefault((r.dtype or "?", r.concurrency), []).append(r.agreement_vs_baseline)
    if not by:
        return ""
    out = []
    for dtype in sorted({d for d, _ in by}):
        loads = sorted((c for d, c in by if d == dtype), key=lambda c: (c is None, c or 0))
        cells = ", ".join(f"{min(by[(dtype, c)]):.0%} at {c if c is not None else 'open-loop'}"
                          f"{' stream' if c == 1 else ' streams' if c is not None else ''}" for c in loads)
        out.append(f"{dtype}: {cells}")
    return ("T=0 replies identical to the baseline's (lowest over the deployments; batched verification can "
            "flip near-ties) " + "; ".join(out))


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
        s += fixed_part(pts, load)
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
    parity = parity_line(spec)  # greedy parity per dtype and load, said beside the paired test (not instead)
    if parity:
        parts.append(parity + ".")
    return " ".join(parts) + quality_alarm(ok, tests=tests) + tail


def fixed_part(pts: list[StudyRow], load) -> str:
    """What a better draft cannot shorten, at the lightest and the heaviest load of ``pts`` (sorted by load):
    the share of the engine's time no τ shortens (``StudyRow.fixed_time_share``: what the prompts add to
    their steps, and each request's first step) and what a draft accepted in full would add there
    (``StudyRow.draft_headroom``), else, for points counted before that, the prompts' share of
    the tokens the target ran; "" where the points have no step counts."""
    timed = [p for p in pts if p.fixed_time_share is not None]
    if timed:
        lo, hi = timed[0], timed[-1]
        s = (f"; work no draft can shorten (what the prompts add to their steps, and each request's first "
             f"step) took {lo.fixed_time_share:.0%} of its engine's time at {load(lo)}"
             + (f" and {hi.fixed_time_share:.0%} at {load(hi)}" if hi is not lo else ""))
        if lo.draft_headroom is not None and hi.draft_headroom is not None:
            s += (f", so a draft accepted in full would add at most {lo.draft_headroom - 1:.0%}"
                  + (f" and {hi.draft_headroom - 1:.0%}" if hi is not lo else "") + " with the same step costs")
        return s
    shares = [p for p in pts if p.prefill_share is not None]
    if not shares:
        return ""
    lo, hi = shares[0], shares[-1]
    return (f"; the prompts' prefill, which speculation does not shorten, was {lo.prefill_share:.0%} of the "
            f"tokens its target ran at {load(lo)}"
            + (f" and {hi.prefill_share:.0%} at {load(hi)}" if hi is not lo else ""))


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
