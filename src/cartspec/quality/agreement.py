"""Is quality preserved? Agreement with the baseline and a paired test on accuracy.

Speculative decoding is lossless in exact arithmetic, but kernels and bf16 make
real runs differ, so this is measured: the candidate's reply to
each request is compared with the baseline's (exact text, and equal as parsed
JSON), and the paired difference in exact-match accuracy gets the quality step's
paired test (``paired.py``: a cluster-bootstrap interval that stays about ±3/n wide
when no pair differs, and an exact sign test, McNemar's with one pair per request).
The verdict is a statistical statement against a stated margin (equivalence:
the interval inside ±margin), never "looks the same".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ..task.data import Request
from .paired import paired_test
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
    # the interval, p-value and verdict of the quality step's paired test (``quality/paired.py``), so the
    # report's agreement table and its verdict say the same thing
    t = paired_test("exact_match", clusters if clusters is not None else list(range(n)),
                    [float(x) for x in ok_a], [float(x) for x in ok_b], margin=margin, n_boot=n_boot, seed=seed,
                    sampled=False)
    return Agreement(n=n, exact_text=exact, same_parsed=same, accuracy_baseline=acc_a, accuracy_candidate=acc_b,
                     diff=acc_b - acc_a, diff_ci95=(t.ci_low, t.ci_high), mcnemar_p=t.p_value, margin=margin,
                     verdict=t.verdict)
