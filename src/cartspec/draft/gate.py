"""The offline gate: is a candidate head better than the current one on held-out recent traffic?

Both versions are measured in vLLM with the same drafter (``method``: eagle3, the head alone, or the hybrid,
each version with its own pointer: the deployed configuration) at the same γ on the same held-out requests
(``draft acceptance``'s ``AcceptanceReport``, with each reply's tokens and per-step accepted counts). Requests
are paired by id (by position when the requests carry no ids). Per request ``i``::

    τ_i = 1 + accepted_i / steps_i        (steps: verify steps that drafted; accepted: drafts accepted)
    d_i = τ_candidate,i - τ_current,i

- τ: the mean of d with a 95% percentile paired bootstrap interval (requests resampled with replacement,
  ``n_boot`` resamples from a seeded generator, so the same reports give the same interval) and the
  Student t interval beside it. Only requests whose replies drafted on both sides are pairs; the rest are
  counted and left out.
- Per token class (``task.classes``): pooled acceptance, accepted / reached, on each side, and a paired
  bootstrap interval of the difference from the same resamples (each resample's pooled rates recomputed).
  A class is *worse beyond the interval* when its interval lies entirely below 0. A class reached in fewer
  than ``min_class_requests`` requests is shown but not judged: a bootstrap over a handful of requests
  gives an interval that only repeats them.
- Eligible: at least ``min_requests`` pairs, the τ interval's lower bound above 0, and no class worse
  beyond its interval. ``reasons`` says why, one plain sentence per finding.

``decide`` is the decision on per-request counts (no model, no tokenizer); ``gate_reports`` places two
reports' accepted drafts on their reply tokens (``simulate.steps_from_vllm``) and calls it.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..results_acceptance import AcceptanceReport
from ..task.classes import CLASSES
from ..task.data import Request

CONFIDENCE = 0.95
MIN_REQUESTS = 30
MIN_CLASS_REQUESTS = 10
N_BOOT = 2000


class GateError(ValueError):
    """The two measurements cannot be compared (another γ, target, method or request set)."""


class RequestCounts(BaseModel):
    """One reply's draft counts: verify steps that drafted, drafts accepted, and per token class the drafts
    the verifier looked at (``reached``) and those it accepted."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(0, ge=0)
    accepted: int = Field(0, ge=0)
    classes: dict[str, tuple[int, int]] = Field(default_factory=dict, description="class -> (reached, accepted)")

    @property
    def tau(self) -> float | None:
        return 1 + self.accepted / self.steps if self.steps else None


class ClassGate(BaseModel):
    """One token class on both sides: pooled acceptance and the paired interval of the difference."""

    model_config = ConfigDict(extra="forbid")

    token_class: str
    requests: int = Field(..., description="pairs in which either head's steps reached the class")
    reached_candidate: int
    accepted_candidate: int
    reached_current: int
    accepted_current: int
    candidate: float | None = None
    current: float | None = None
    diff: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    judged: bool = Field(False, description="reached in at least min_class_requests pairs on both sides")
    worse: bool = Field(False, description="judged, and the interval lies entirely below 0")


class HeldOut(BaseModel):
    """The traffic the gate measured on."""

    model_config = ConfigDict(extra="forbid")

    traffic: str | None = None
    share: float | None = Field(None, description="most recent share of the deduplicated records held out")
    records: int | None = Field(None, description="deduplicated records in the traffic")
    held_out: int | None = Field(None, description="records in the most recent share")
    after: float | None = Field(None, description="only records after this ts (the candidate's training window end)")
    left_out_trained: int = Field(0, description="held-out records at or before `after`, left out")
    limit: int | None = None
    requests: int = 0
    first_ts: float | None = None
    last_ts: float | None = None
    served_gamma: list[int] = Field(default_factory=list, description="the γ the held-out records were served at")
    note: str | None = None


class GateDecision(BaseModel):
    """The gate's decision on a candidate head version against the current one, with its figures."""

    model_config = ConfigDict(extra="forbid")

    v: int = 1
    eligible: bool
    reasons: list[str] = Field(default_factory=list)
    candidate: str | None = Field(None, description="the candidate's ref, NAME@vNNNN")
    current: str | None = Field(None, description="the current head's ref")
    gamma: int | None = None
    target: str | None = None
    method: str | None = Field(None, description="the drafter both sides were measured with: eagle3 | hybrid")
    pointer_candidate: str | None = Field(None, description="hybrid: the candidate's pointer, its digest "
                                                            "(pointer_digest) or 'bundled'; None: no pointer")
    pointer_current: str | None = None
    requests: int = Field(0, description="requests paired by id (or position)")
    n: int = Field(0, description="pairs in which both replies drafted: the figures' sample")
    left_out: int = Field(0, description="paired requests left out: a reply without draft steps on a side")
    replies_differ: int = Field(0, description="pairs whose reply tokens differ between the two runs")
    min_requests: int = MIN_REQUESTS
    min_class_requests: int = MIN_CLASS_REQUESTS
    confidence: float = CONFIDENCE
    n_boot: int = N_BOOT
    seed: int = 0
    tau_candidate: float | None = Field(None, description="mean per-request τ")
    tau_current: float | None = None
    tau_pooled_candidate: float | None = Field(None, description="1 + all accepted / all steps, as draft acceptance")
    tau_pooled_current: float | None = None
    diff: float | None = Field(None, description="mean of the per-request τ differences, candidate - current")
    ci_low: float | None = Field(None, description="paired bootstrap interval of diff")
    ci_high: float | None = None
    t_low: float | None = Field(None, description="Student t interval of diff")
    t_high: float | None = None
    classes: list[ClassGate] = Field(default_factory=list)
    held_out: HeldOut | None = None
    reports: dict[str, str] = Field(default_factory=dict, description="where the two AcceptanceReports were written")
    created: float = Field(default_factory=time.time)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "GateDecision":
        return cls.model_validate_json(Path(path).read_text())


# --- statistics ---------------------------------------------------------------------------------------------

def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student t distribution function."""
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Inverse of ``t_cdf`` (bisection; p in (0, 1))."""
    if not 0 < p < 1:
        raise ValueError("p must be in (0, 1)")
    if p == 0.5:
        return 0.0
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > p:
        lo *= 2
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2


def t_interval(d: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Student t interval of the mean of ``d``; None with fewer than two values."""
    x = np.asarray(d, dtype=float)
    n = len(x)
    if n < 2:
        return None
    half = t_quantile(0.5 + confidence / 2, n - 1) * float(x.std(ddof=1)) / math.sqrt(n)
    m = float(x.mean())
    return m - half, m + half


def _resamples(n: int, n_boot: int, seed: int):
    """Batches of bootstrap index rows (each row: n indices into the pairs), from one seeded generator."""
    rng = np.random.default_rng(seed)
    batch = max(1, 2_000_000 // max(n, 1))  # rows at a time: memory stays small with many requests
    for k in range(0, n_boot, batch):
        yield rng.integers(0, n, size=(min(batch, n_boot - k), n))


def _quantiles(boots: np.ndarray, confidence: float) -> tuple[float, float] | None:
    boots = boots[np.isfinite(boots)]
    if len(boots) == 0:
        return None
    a = (1 - confidence) / 2
    lo, hi = np.quantile(boots, [a, 1 - a])
    return float(lo), float(hi)


# --- the decision -------------------------------------------------------------------------------------------

def _signed(x: float) -> str:
    return f"{x:+.3f}" if abs(x) < 0.1 else f"{x:+.2f}"


def _iv(lo: float, hi: float) -> str:
    digits = 3 if max(abs(lo), abs(hi)) < 0.1 else 2
    return f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def decide(candidate: Sequence[RequestCounts], current: Sequence[RequestCounts], *, gamma: int | None = None,
           candidate_ref: str | None = None, current_ref: str | None = None, target: str | None = None,
           method: str | None = None, min_requests: int = MIN_REQUESTS,
           min_class_requests: int = MIN_CLASS_REQUESTS, n_boot: int = N_BOOT, seed: int = 0,
           confidence: float = CONFIDENCE, replies_differ: int = 0,
           held_out: HeldOut | None = None) -> GateDecision:
    """The gate on paired per-request counts: ``candidate[i]`` and ``current[i]`` are the same request."""
    if len(candidate) != len(current):
        raise GateError(f"{len(candidate)} candidate replies against {len(current)} current ones: the gate "
                        "compares the same requests")
    if n_boot < 100:
        raise ValueError("n_boot: at least 100 resamples")
    pairs = [(c, u) for c, u in zip(candidate, current) if c.steps and u.steps]
    n = len(pairs)
    reasons: list[str] = []
    out: dict[str, Any] = dict(candidate=candidate_ref, current=current_ref, gamma=gamma, target=target,
                               method=method, requests=len(candidate), n=n, left_out=len(candidate) - n,
                               replies_differ=replies_differ, min_requests=min_requests,
                               min_class_requests=min_class_requests, confidence=confidence, n_boot=n_boot,
                               seed=seed, held_out=held_out)
    if out["left_out"]:
        reasons.append(f"{out['left_out']} of {len(candidate)} requests left out: a reply without draft steps "
                       "on one side")
    enough = n >= min_requests
    if not enough:
        reasons.append(f"only {n} paired requests with draft steps, fewer than the {min_requests} needed "
                       "(min_requests): not enough to decide")
    if n == 0:
        return GateDecision(eligible=False, reasons=reasons, **out)

    tc = np.array([c.tau for c, _ in pairs], dtype=float)
    tu = np.array([u.tau for _, u in pairs], dtype=float)
    d = tc - tu
    diff = float(d.mean())
    names = list(CLASSES) + sorted({k for c, u in pairs for k in (*c.classes, *u.classes)} - set(CLASSES))
    arr = {side: {k: np.array([[p[i].classes.get(k, (0, 0))[0] for p in pairs],
                               [p[i].classes.get(k, (0, 0))[1] for p in pairs]], dtype=float)
                  for k in names}
           for i, side in enumerate(("candidate", "current"))}
    boots_tau: list[np.ndarray] = []
    boots_cls: dict[str, list[np.ndarray]] = {k: [] for k in names}
    with np.errstate(invalid="ignore", divide="ignore"):
        for pick in _resamples(n, n_boot, seed):
            boots_tau.append(d[pick].mean(axis=1))
            for k in names:
                (rc, ac), (ru, au) = arr["candidate"][k], arr["current"][k]
                boots_cls[k].append(ac[pick].sum(1) / rc[pick].sum(1) - au[pick].sum(1) / ru[pick].sum(1))
    iv = _quantiles(np.concatenate(boots_tau), confidence)
    assert iv is not None
    ti = t_interval(d, confidence)
    tau_c, tau_u = float(tc.mean()), float(tu.mean())
    steps_c, steps_u = sum(c.steps for c, _ in pairs), sum(u.steps for _, u in pairs)
    out.update(tau_candidate=tau_c, tau_current=tau_u, diff=diff, ci_low=iv[0], ci_high=iv[1],
               t_low=ti[0] if ti else None, t_high=ti[1] if ti else None,
               tau_pooled_candidate=1 + sum(c.accepted for c, _ in pairs) / steps_c,
               tau_pooled_current=1 + sum(u.accepted for _, u in pairs) / steps_u)
    above = iv[0] > 0
    reasons.append(f"τ {tau_c:.2f} vs {tau_u:.2f}: {_signed(diff)} {_iv(*iv)}, "
                   + ("above 0" if above else "not above 0"))

    classes = []
    for k in names:
        (rc, ac), (ru, au) = arr["candidate"][k], arr["current"][k]
        reached = int(((rc > 0) | (ru > 0)).sum())
        if not reached:
            continue
        both = int(min((rc > 0).sum(), (ru > 0).sum()))
        R_c, A_c, R_u, A_u = int(rc.sum()), int(ac.sum()), int(ru.sum()), int(au.sum())
        cg = ClassGate(token_class=k, requests=reached, reached_candidate=R_c, accepted_candidate=A_c,
                       reached_current=R_u, accepted_current=A_u,
                       candidate=A_c / R_c if R_c else None, current=A_u / R_u if R_u else None)
        if R_c and R_u:
            cg.diff = cg.candidate - cg.current  # type: ignore[operator]
            civ = _quantiles(np.concatenate(boots_cls[k]), confidence)
            if civ is not None:
                cg.ci_low, cg.ci_high = civ
            cg.judged = both >= min_class_requests and civ is not None
            cg.worse = cg.judged and civ is not None and civ[1] < 0
        classes.append(cg)
        if cg.worse:
            reasons.append(f"class {k} worse: {_signed(cg.diff)} "  # type: ignore[arg-type]
                           f"{_iv(cg.ci_low, cg.ci_high)} ({cg.current:.3f} -> {cg.candidate:.3f})")  # type: ignore[arg-type]
    worse = [c.token_class for c in classes if c.worse]
    unjudged = [c.token_class for c in classes if not c.judged]
    if not worse:
        reasons.append("no token class worse beyond its interval"
                       + (f" ({', '.join(unjudged)}: reached in fewer than {min_class_requests} requests "
                          "on a side, not judged)" if unjudged else ""))
    eligible = enough and above and not worse
    return GateDecision(eligible=eligible, reasons=reasons, classes=classes, **out)


# --- from two AcceptanceReports -----------------------------------------------------------------------------

Classify = Callable[[Sequence[Request], Sequence[Sequence[int]]], list[list[str]]]


def counts_from_reply(per_step_accepted: Sequence[int] | None, classes: Sequence[str], gamma: int) -> RequestCounts:
    """Place one reply's accepted counts on its tokens (every EAGLE-3 or hybrid step drafts γ) and count per class as
    ``simulate.summarize`` does: a step reaches its drafts up to and including the first rejected one."""
    from .simulate import steps_from_vllm

    acc = list(per_step_accepted or [])
    by: dict[str, list[int]] = {}
    for st in steps_from_vllm(acc, [gamma] * len(acc), classes):
        for k, c in enumerate(st.classes[:st.accepted + 1]):
            if k >= st.drafted:
                break
            v = by.setdefault(c, [0, 0])
            v[0] += 1
            v[1] += int(k < st.accepted)
    return RequestCounts(steps=len(acc), accepted=sum(acc), classes={c: (r, a) for c, (r, a) in by.items()})


def _pair(candidate: AcceptanceReport, current: AcceptanceReport, reqs: Sequence[Request]):
    """The replies of both reports and the request of each, in the order of ``reqs``."""
    if candidate.replies is None or current.replies is None:
        side = "candidate" if candidate.replies is None else "current"
        raise GateError(f"the {side}'s report has no per-reply steps (replies): measure it in vLLM with "
                        "`cartspec draft acceptance` (not --simulate)")
    rc, ru = candidate.replies, current.replies
    n = len(reqs)
    if len(rc) != n or len(ru) != n:
        raise GateError(f"request sets differ: {len(rc)} candidate replies, {len(ru)} current ones, {n} requests")
    ids = [r.id for r in reqs]
    if all(i is not None for i in ids):
        if len(set(ids)) != n:
            raise GateError("the requests' ids repeat: pair them by position (no ids) or deduplicate them")
        by_c, by_u = {x.id: x for x in rc}, {x.id: x for x in ru}
        for side, by in (("candidate", by_c), ("current", by_u)):
            missing = [i for i in ids if i not in by]
            if missing:
                raise GateError(f"request sets differ: the {side}'s report has no reply for {len(missing)} of "
                                f"the {n} requests (first: {missing[0]!r})")
        return [by_c[i] for i in ids], [by_u[i] for i in ids]
    for side, replies in (("candidate", rc), ("current", ru)):
        if any(x.id is not None for x in replies):
            raise GateError(f"request sets differ: the requests carry no ids but the {side}'s replies do")
    return list(rc), list(ru)


def check_comparable(candidate: AcceptanceReport, current: AcceptanceReport, gamma: int | None = None,
                     method: str | None = None) -> None:
    """Refuse two measurements that are not of the same thing (γ, target, method, the hybrid's lookup) or not
    of the drafter asked (``method``)."""
    if method is not None:
        for side, r in (("candidate", candidate), ("current", current)):
            if r.method != method:
                raise GateError(f"the {side}'s report was measured with method {r.method!r}, the gate was asked "
                                f"for {method!r}: measure both versions with `draft acceptance --method {method}` "
                                "(or gate with the method they were measured with)")
    if candidate.gamma != current.gamma:
        raise GateError(f"measured at different γ: candidate γ={candidate.gamma}, current γ={current.gamma}; "
                        "measure both at the served γ")
    if gamma is not None and candidate.gamma != gamma:
        raise GateError(f"measured at γ={candidate.gamma}, the gate was asked for γ={gamma}")
    if candidate.target and current.target and candidate.target != current.target:
        raise GateError(f"measured on different targets: {candidate.target} and {current.target}")
    if candidate.method and current.method and candidate.method != current.method:
        raise GateError(f"measured with different methods: {candidate.method} and {current.method}")
    lookup = ("n_min", "n_max", "scope")
    hc, hu = candidate.hybrid or {}, current.hybrid or {}
    if candidate.method == "hybrid" and any(hc.get(k) != hu.get(k) for k in lookup):
        raise GateError(f"the hybrids were measured with different lookups: candidate "
                        f"{ {k: hc.get(k) for k in lookup} }, current { {k: hu.get(k) for k in lookup} }")
    for side, r in (("candidate", candidate), ("current", current)):
        if r.temperature not in (None, 0.0):
            raise GateError(f"the {side} was measured at temperature {r.temperature}: the gate compares "
                            "greedy (T=0) replies")


def gate_reports(candidate: AcceptanceReport, current: AcceptanceReport, reqs: Sequence[Request],
                 tokenizer: Any = None, *, classify: Classify | None = None, gamma: int | None = None,
                 candidate_ref: str | None = None, current_ref: str | None = None,
                 min_requests: int = MIN_REQUESTS, min_class_requests: int = MIN_CLASS_REQUESTS,
                 n_boot: int = N_BOOT, seed: int = 0, held_out: HeldOut | None = None,
                 method: str | None = None) -> GateDecision:
    """The gate on two ``AcceptanceReport``s of the same requests ``reqs``. Token classes come from
    ``classify(reqs, outputs)`` (default: ``acceptance.classes_for`` with ``tokenizer``). ``method``: the drafter
    both must have been measured with (eagle3 | hybrid; None: whichever, the same on both sides)."""
    check_comparable(candidate, current, gamma, method)
    g = candidate.gamma
    if g is None:
        raise GateError("the reports do not say their γ")
    rc, ru = _pair(candidate, current, reqs)
    if classify is None:
        if tokenizer is None:
            raise ValueError("gate_reports needs the target's tokenizer (or classify) to place token classes")
        from .acceptance import classes_for

        def classify(rs, outs):  # noqa: E306
            return classes_for(tokenizer, rs, outs)

    cls_c = classify(reqs, [x.token_ids for x in rc])
    same = [list(a.token_ids) == list(b.token_ids) for a, b in zip(rc, ru)]
    # identical replies share their classes; only differing ones are classified again
    diff_ix = [i for i, s in enumerate(same) if not s]
    cls_u = list(cls_c)
    if diff_ix:
        again = classify([reqs[i] for i in diff_ix], [ru[i].token_ids for i in diff_ix])
        for i, cl in zip(diff_ix, again):
            cls_u[i] = cl
    counts_c = [counts_from_reply(x.per_step_accepted, cl, g) for x, cl in zip(rc, cls_c)]
    counts_u = [counts_from_reply(x.per_step_accepted, cl, g) for x, cl in zip(ru, cls_u)]
    d = decide(counts_c, counts_u, gamma=g, candidate_ref=candidate_ref, current_ref=current_ref,
               target=candidate.target, method=candidate.method, min_requests=min_requests,
               min_class_requests=min_class_requests, n_boot=n_boot, seed=seed,
               replies_differ=len(diff_ix), held_out=held_out)
    d.pointer_candidate, d.pointer_current = report_pointer(candidate), report_pointer(current)
    return d


def pointer_digest(pointer_dir: str | Path) -> str:
    """What a pointer is, for the decision: ``bundled`` (the pointer shipped with cartspec), else the first 12
    hex digits of its files' digest (config.json, pointer.safetensors), the same wherever the directory lies."""
    from ..model.registry import BUNDLED_POINTER, POINTERS_DIR
    from ..model.registry import pointer_digest as digest

    path = Path(pointer_dir).expanduser()
    if path.resolve() == (POINTERS_DIR / BUNDLED_POINTER).resolve():
        return "bundled"
    if not all((path / f).is_file() for f in ("config.json", "pointer.safetensors")):
        return f"{path} (no longer there)"
    return digest(path)[:12]


def report_pointer(report: AcceptanceReport) -> str | None:
    """The pointer a hybrid report drafted with (``pointer_digest``); None for another method or a hybrid
    without one (rule head: the head alone)."""
    pointer = (report.hybrid or {}).get("pointer") if report.method == "hybrid" else None
    return pointer_digest(pointer) if pointer else None
