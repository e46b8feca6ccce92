"""Paired structured tests of a candidate's replies against the baseline's, with a verdict against a margin.

Each pair is one request (and sample index) answered by both deployments. Per metric, a pair has a value
on each side (exact match, JSON validity, schema validity: 0 or 1; field accuracy: the reply's share of
correct fields) and a difference ``d = candidate - baseline`` in [-1, 1]. Pairs of the same request
(several samples, or the same request at several loads of a sweep) are one *cluster*: they are not
independent, so the interval resamples whole clusters.

- Estimate: Δ = Σd / pairs (a ratio estimator over clusters).
- Interval: 95% percentile cluster bootstrap. Two pseudo-clusters, one discordant each way (d = +1 and
  d = -1 per pair, the paired analogue of adding ½ to the discordant cells), join the resampled units, so
  that a sample with no discordant pair at all gets an interval of about ±3/units (the "rule of three")
  rather than the degenerate [0, 0]. A unit is a distinct (request, sample): the same request and sample
  at several loads of a sweep carries the same seed and is nearly a copy, so each pseudo-cluster is as
  many pairs as a unit has on average.
- p-value: an exact sign test on the clusters' net differences (McNemar's exact test on the discordant
  pairs when every cluster is one pair).
- Verdict (equivalence by two one-sided tests at 2.5% each, i.e. the 95% interval): ``preserved`` when the
  interval lies inside (-margin, +margin); ``worse`` when it lies entirely below -margin; otherwise
  ``inconclusive`` (including an interval entirely above +margin: better than the baseline by more than
  the margin is not "the same", and it is flagged in ``note``).
- Sample size (``needed_n``, when inconclusive): requests needed at the current samples per request for
  80% power to conclude equivalence when the true difference is 0 (or, when the requests at hand would
  already do for a zero difference, the difference observed), from the observed paired variance s² of
  the difference per distinct (request, sample): N* = (z_.975 + z_.90)² · s² / margin² paired units (plus
  the pseudo-pairs' share, so a sample without discordance asks for the rule of three's count).
  ``needed_samples``: samples per request that give N* with the current requests, assuming the samples
  of a request are independent draws (their seeds differ), which holds at T > 0 when the requests' own
  true differences do not vary (under "no difference" they do not).
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Literal, Sequence

import numpy as np
from pydantic import BaseModel, Field

Verdict = Literal["preserved", "worse", "inconclusive"]
METRICS = ("exact_match", "field_accuracy", "json_valid", "schema_valid")
BINARY = {"exact_match", "json_valid", "schema_valid"}
Z_975 = 1.959964
Z_90 = 1.281552  # power 80% for two one-sided tests at true difference 0 (β/2 per side)
TEST_NAME = ("equivalence: 95% cluster-bootstrap interval of the paired difference inside ±margin "
             "(two one-sided tests at 2.5%)")


class PairedTest(BaseModel):
    """One metric's paired comparison of a candidate with the baseline."""

    metric: str
    pairs: int
    requests: int = Field(..., description="clusters: distinct requests")
    samples: int = Field(1, description="distinct sample indices per request (max)")
    baseline: float
    candidate: float
    diff: float
    ci_low: float
    ci_high: float
    p_value: float = Field(..., description="exact sign test on the requests' net differences (McNemar when one "
                                            "pair per request)")
    discordant: tuple[int, int] = Field(..., description="(requests netting for the baseline, for the candidate)")
    margin: float
    verdict: Verdict
    needed_n: int | None = Field(None, description="inconclusive: requests needed at this many samples per request")
    needed_samples: int | None = Field(None, description="inconclusive: samples per request needed with these "
                                                         "requests")
    note: str | None = None


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided binomial test of wins vs losses at p = ½ (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def verdict_for(lo: float, hi: float, margin: float) -> Verdict:
    if -margin < lo and hi < margin:
        return "preserved"
    if hi < -margin:
        return "worse"
    return "inconclusive"


def paired_test(metric: str, clusters: Sequence[Hashable], base: Sequence[float], cand: Sequence[float],
                margin: float = 0.02, samples: Sequence[int] | None = None, n_boot: int = 4000,
                seed: int = 0, sampled: bool = True) -> PairedTest:
    """The paired test of one metric; ``clusters[i]`` names the request pair i belongs to, ``samples[i]`` its
    sample index. ``sampled``: replies were sampled (T > 0), so more samples per request are worth
    suggesting; at T = 0 they would be copies and only more requests help."""
    n = len(clusters)
    if n == 0 or len(base) != n or len(cand) != n:
        raise ValueError("paired_test needs one cluster key, baseline and candidate value per pair, and one pair")
    if margin <= 0:
        raise ValueError("margin must be > 0")
    a = np.asarray(base, dtype=float)
    b = np.asarray(cand, dtype=float)
    d = b - a
    index: dict[Hashable, int] = {}
    ids = np.array([index.setdefault(c, len(index)) for c in clusters])
    r = len(index)
    D = np.bincount(ids, weights=d, minlength=r)
    M = np.bincount(ids, minlength=r).astype(float)
    diff = float(d.sum() / n)
    sample_ix = list(samples) if samples is not None else [0] * n
    copies = n / len(set(zip(clusters, sample_ix)))  # pairs per distinct (request, sample)
    # bootstrap over clusters plus the two pseudo-clusters (d = +1 and -1 on each of `copies` pairs)
    Dx, Mx = np.concatenate([D, [copies, -copies]]), np.concatenate([M, [copies, copies]])
    rng = np.random.default_rng(seed)
    units = len(Dx)
    batch = max(1, 2_000_000 // units)  # resamples at a time: memory stays small with many requests
    boots = np.concatenate([
        (lambda pick: Dx[pick].sum(axis=1) / Mx[pick].sum(axis=1))(
            rng.integers(0, units, size=(min(batch, n_boot - k), units)))
        for k in range(0, n_boot, batch)])
    lo, hi = (float(x) for x in np.quantile(boots, [0.025, 0.975]))
    lo, hi = min(lo, diff), max(hi, diff)
    nets_b, nets_c = int((D < -1e-12).sum()), int((D > 1e-12).sum())
    verdict = verdict_for(lo, hi, margin)
    n_samples = len(set(sample_ix))
    needed_n = needed_k = None
    note = None
    if verdict == "inconclusive":
        if lo >= margin:
            note = "better than the baseline by more than the margin: not equivalent, not worse"
        # the observed paired variance, per distinct (request, sample): copies at several loads averaged
        units: dict[tuple, list[float]] = {}
        for key, dv in zip(zip(clusters, sample_ix), d):
            units.setdefault(key, []).append(float(dv))
        unit_d = np.array([sum(v) / len(v) for v in units.values()])
        s2 = float(np.var(unit_d, ddof=1)) if len(unit_d) > 1 else 0.0
        z = Z_975 + Z_90
        if -margin < diff < margin:
            units_needed = pairs_needed(s2, margin / z)
            if units_needed <= len(unit_d) and abs(diff) > 0:
                # enough for a zero difference: plan for the difference observed instead
                units_needed = pairs_needed(s2, (margin - abs(diff)) / z)
            per_request = len(unit_d) / r  # samples per request now
            needed_n = max(r + 1, math.ceil(units_needed / per_request))
            needed_k = max(n_samples + 1, math.ceil(units_needed / r)) if sampled else None
        else:
            note = (note or "") + ("; " if note else "") + \
                "observed difference at or beyond the margin: more pairs decide between worse and inconclusive"
    return PairedTest(metric=metric, pairs=n, requests=r, samples=n_samples, baseline=float(a.mean()),
                      candidate=float(b.mean()), diff=diff, ci_low=lo, ci_high=hi,
                      p_value=sign_test(nets_c, nets_b), discordant=(nets_b, nets_c), margin=margin,
                      verdict=verdict, needed_n=needed_n, needed_samples=needed_k, note=note)


def pairs_needed(s2: float, se: float) -> float:
    """Independent paired units N at which the standard error of the mean difference reaches ``se``:
    SE² = s²/N from the observed per-unit variance, plus 2/N² from the two pseudo-pairs (so a sample
    without any discordance still asks for about the rule of three's count rather than for none)."""
    a, b, t = 2.0, s2, se ** 2
    x = (-b + math.sqrt(b * b + 4 * a * t)) / (2 * a)  # x = 1/N
    return 1 / x


def metric_values(item: Any) -> dict[str, float | None]:
    """A scored reply (``task.score.ItemScore``) as the metrics' values; None where gold is missing."""
    fields = item.fields
    return {
        "exact_match": None if item.exact is None else float(bool(item.exact)),
        "field_accuracy": None if item.exact is None else (sum(fields.values()) / len(fields) if fields else 1.0),
        "json_valid": float(item.json_valid),
        "schema_valid": float(item.schema_valid),
    }


class FieldDelta(BaseModel):
    """Accuracy of one field name, baseline vs candidate, over the pairs where gold or either reply sets it."""

    field: str
    pairs: int
    baseline: float
    candidate: float
    diff: float
    p_value: float = Field(..., description="exact McNemar on the discordant pairs")


def field_deltas(items: Sequence[tuple[Any, Any]]) -> list[FieldDelta]:
    """Per field name: (baseline ItemScore, candidate ItemScore) pairs -> accuracy on each side. A field
    neither gold nor that reply sets counts as right for that reply (nothing to get wrong)."""
    per: dict[str, list[tuple[bool, bool]]] = {}
    for a, b in items:
        if a.exact is None or b.exact is None:
            continue
        for k in set(a.fields) | set(b.fields):
            per.setdefault(k, []).append((a.fields.get(k, True), b.fields.get(k, True)))
    out = []
    for k, v in sorted(per.items()):
        ba = sum(x for x, _ in v) / len(v)
        ca = sum(y for _, y in v) / len(v)
        only_b = sum(1 for x, y in v if x and not y)
        only_c = sum(1 for x, y in v if y and not x)
        out.append(FieldDelta(field=k, pairs=len(v), baseline=ba, candidate=ca, diff=ca - ba,
                              p_value=sign_test(only_c, only_b)))
    return out
