"""Is quality preserved? Agreement with the baseline and a paired test on accuracy.

Speculative decoding is lossless in exact arithmetic, but kernels and bf16 make
real runs differ, so this is measured: the candidate's reply to
each request is compared with the baseline's (exact text, and equal as parsed
JSON), and the paired difference in exact-match accuracy gets a bootstrap
interval and an exact McNemar test. The verdict is a statistical statement
against a stated margin, never "looks the same".
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from typing import Any

from ..task.data import Request
from ..task.score import score_item


@dataclass
class Agreement:
    n: int
    exact_text: float          # identical reply strings
    same_parsed: float         # equal once parsed and canonicalised
    accuracy_baseline: float   # exact match against gold
    accuracy_candidate: float
    diff: float                # candidate - baseline
    diff_ci95: tuple[float, float]
    mcnemar_p: float           # exact two-sided, on discordant pairs
    margin: float
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact binomial test on the discordant pairs (b: only baseline right)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def _parsed(task: str, text: str) -> str | None:
    from ..task.parse import read_reply
    from ..task.schema import canonical_dict

    value = read_reply(task, text).value
    return json.dumps(canonical_dict(value), sort_keys=True) if value is not None else None


def compare(requests: list[Request], baseline: list[str], candidate: list[str], margin: float = 0.02,
            n_boot: int = 2000, seed: int = 0, clusters: list[Any] | None = None) -> Agreement:
    """Quality of ``candidate`` replies against ``baseline`` replies to the same requests.

    Verdict "preserved" when the 95% bootstrap interval of the accuracy difference
    lies above ``-margin``; "worse" when it lies below; otherwise "inconclusive".

    ``clusters`` (one key per pair) marks pairs that are not independent, e.g. the same request
    answered at several loads of a sweep: the bootstrap then resamples whole clusters, and the
    p-value is an exact sign test on the clusters' net differences (McNemar when every cluster
    holds one pair).
    """
    if not (len(requests) == len(baseline) == len(candidate)) or not requests:
        raise ValueError("requests, baseline and candidate must be non-empty and of equal length")
    ok_a = [bool(score_item(r, t).exact) for r, t in zip(requests, baseline)]
    ok_b = [bool(score_item(r, t).exact) for r, t in zip(requests, candidate)]
    return compare_scored([r.task for r in requests], baseline, candidate, ok_a, ok_b, margin=margin,
                          n_boot=n_boot, seed=seed, clusters=clusters)


def compare_scored(tasks: list[str], baseline: list[str], candidate: list[str], ok_a: list[bool],
                   ok_b: list[bool], margin: float = 0.02, n_boot: int = 2000, seed: int = 0,
                   clusters: list[Any] | None = None) -> Agreement:
    """``compare`` on replies already scored against gold (``ok_*``: exact match per pair)."""
    n = len(tasks)
    if not n or not (len(baseline) == len(candidate) == len(ok_a) == len(ok_b) == n):
        raise ValueError("tasks, replies and scores must be non-empty and of equal length")
    if clusters is not None and len(clusters) != n:
        raise ValueError("clusters must give one key per request")
    exact = sum(a == b for a, b in zip(baseline, candidate)) / n
    same = sum(_parsed(t, a) == _parsed(t, b) for t, a, b in zip(tasks, baseline, candidate)) / n
    acc_a, acc_b = sum(ok_a) / n, sum(ok_b) / n
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(clusters if clusters is not None else range(n)):
        groups.setdefault(key, []).append(i)
    # per cluster: (pairs, net difference in exact matches)
    units = [(len(ix), sum(ok_b[i] - ok_a[i] for i in ix)) for ix in groups.values()]
    rng = random.Random(seed)
    diffs = []
    for _ in range(n_boot):
        pick = [units[rng.randrange(len(units))] for _ in units]
        diffs.append(sum(d for _, d in pick) / sum(m for m, _ in pick))
    diffs.sort()
    lo, hi = diffs[int(0.025 * n_boot)], diffs[int(0.975 * n_boot) - 1]
    b = sum(d < 0 for _, d in units)
    c = sum(d > 0 for _, d in units)
    verdict = "preserved" if lo > -margin else "worse" if hi < -margin else "inconclusive"
    return Agreement(n=n, exact_text=exact, same_parsed=same, accuracy_baseline=acc_a, accuracy_candidate=acc_b,
                     diff=acc_b - acc_a, diff_ci95=(lo, hi), mcnemar_p=_mcnemar_exact(b, c), margin=margin,
                     verdict=verdict)
