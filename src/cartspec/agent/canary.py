"""Canary: try a candidate draft head on a share of live traffic, then promote it or roll it back.

The candidate is the same target and the same drafter with another head (the main
spec with its head swapped, ``wiring.canary_spec``: a hybrid stays a hybrid and
drafts with the candidate version's own pointer where it keeps one), so the two
arms compare deployments, and every reply is still the target's: only how many draft tokens it
accepts, and how fast it answers, can differ. A strategy object fed back with
what happened, like the acceptance fallback: ``route()`` once per request bound
for the speculative deployment, ``observe()`` once per answered (or failed)
request of either arm. Three states::

    trial --(candidate τ ≥ (1 + margin) × current τ, interval's lower bound > 0,
             ≥ min_requests candidate replies)--> promoted
    trial --(candidate rolling acceptance < rollback_acceptance × current's, or its
             error rate > current's + max_error_increase, ≥ min_rollback_requests)--> rolled_back

In trial every k-th speculative-bound request (k = round(1 / share)) goes to the
candidate: a counter, not a coin, so a run is reproducible. Promoted: every one
does; rolled back: none. Both end states are final for the process; the caller
writes them to the head registry, so a restart serves what was decided.

The comparison is per request: τ (1 + accepted / verify steps) of each reply that
drafted, and the latency of its model calls. The interval of a difference is a
normal (Welch) 95% interval of the two means, from running sums: constant work
per request. Acceptance (accepted / proposed draft tokens) is pooled per arm,
over the whole trial and over the last ``window_requests`` replies for rollback.
Side effects (metrics, logs, the registry) are the caller's: ``observe`` returns
the ``Decision`` it made.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from .acceptance import AcceptanceStats, pooled
from .config import CanaryConfig

State = Literal["trial", "promoted", "rolled_back"]
Arm = Literal["candidate", "current"]
STATES: tuple[State, ...] = ("trial", "promoted", "rolled_back")
Z95 = 1.959963984540054


@dataclass
class Moments:
    """Count, mean and variance of a stream of numbers, from running sums."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x
        self.squares += x * x

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    @property
    def var(self) -> float | None:
        """Sample variance (n - 1); None under two values."""
        if self.n < 2:
            return None
        return max(0.0, (self.squares - self.total * self.total / self.n) / (self.n - 1))


def welch_interval(a: Moments, b: Moments, z: float = Z95) -> tuple[float, float, float] | None:
    """mean(a) - mean(b) and its normal interval (Welch's standard error); None under two values each."""
    if a.var is None or b.var is None:
        return None
    diff = a.mean - b.mean
    half = z * math.sqrt(a.var / a.n + b.var / b.n)
    return diff, diff - half, diff + half


class ArmStats:
    """What one arm (candidate or current) did during the trial."""

    def __init__(self, window: int):
        self.requests = 0                 # answered or failed
        self.errors = 0
        self.replies = 0                  # answered with drafts (observations)
        self.tau = Moments()              # per-request τ of replies that drafted
        self.rate = Moments()             # per-request accepted / proposed
        self.latency_ms = Moments()       # model time of each answered request
        self.total = AcceptanceStats()    # pooled over the trial
        self.window: deque[AcceptanceStats] = deque(maxlen=window)
        self.outcomes: deque[bool] = deque(maxlen=window)  # True: an error

    def add(self, stats: AcceptanceStats | None, latency_ms: float | None, error: bool) -> None:
        self.requests += 1
        self.outcomes.append(error)
        if error:
            self.errors += 1
            return
        if latency_ms is not None:
            self.latency_ms.add(latency_ms)
        if stats is None or stats.rate is None or stats.tau is None:
            return  # drafted nothing: no observation of the head
        self.replies += 1
        self.tau.add(stats.tau)
        self.rate.add(stats.rate)
        self.total = pooled([self.total, stats])
        self.window.append(stats)

    @property
    def rolling_acceptance(self) -> float | None:
        return pooled(self.window).rate if self.window else None

    @property
    def rolling_error_rate(self) -> float | None:
        return sum(self.outcomes) / len(self.outcomes) if self.outcomes else None

    def figures(self) -> dict[str, Any]:
        return {"requests": self.requests, "replies": self.replies, "errors": self.errors,
                "error_rate": _r(self.rolling_error_rate), "acceptance": _r(self.total.rate),
                "rolling_acceptance": _r(self.rolling_acceptance), "tau": _r(self.tau.mean),
                "latency_ms": _r(self.latency_ms.mean, 1)}


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


@dataclass(frozen=True)
class CanaryView:
    """The canary as one request saw it: goes into its trace line and its ``X-Cartspec-Canary`` header."""

    state: State
    arm: Arm                   # who answered: the candidate head or the current one
    share: float               # the candidate's share of speculative-bound traffic now
    n: int                     # candidate replies observed in the trial
    current_n: int = 0
    candidate_tau: float | None = None
    current_tau: float | None = None
    candidate_acceptance: float | None = None
    current_acceptance: float | None = None
    decision: str | None = None            # promote | rollback, on the request that made it
    figures: dict[str, Any] | None = None  # the decision's figures, on that request


@dataclass(frozen=True)
class Decision:
    decision: Literal["promote", "rollback"]
    reason: str                # better | acceptance | errors
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def state(self) -> State:
        return "promoted" if self.decision == "promote" else "rolled_back"

    def describe(self) -> str:
        f = self.figures
        c, k = f.get("candidate", {}), f.get("current", {})
        counts = f"candidate {c.get('replies')} replies, current {k.get('replies')}"
        if self.reason == "better":
            lo, hi = f["tau_diff_ci"]
            return (f"canary: promote: candidate τ {c['tau']:.3f} vs current {k['tau']:.3f} "
                    f"(difference {f['tau_diff']:+.3f}, 95% interval [{lo:+.3f}, {hi:+.3f}], margin "
                    f"{f['margin']:.0%}) over {counts}; all speculative traffic goes to the candidate")
        if self.reason == "acceptance":
            return (f"canary: rollback: candidate rolling acceptance {c['rolling_acceptance']:.3f} < "
                    f"{f['rollback_acceptance']:g} × current {k['rolling_acceptance']:.3f} over {counts}; "
                    "the candidate gets no more traffic")
        return (f"canary: rollback: candidate error rate {c['error_rate']:.3f} > current {k['error_rate']:.3f} "
                f"+ {f['max_error_increase']:g} over {c.get('requests')} candidate requests; "
                "the candidate gets no more traffic")


class Canary:
    """The trial of a candidate head against the current one (see the module's docstring)."""

    def __init__(self, config: CanaryConfig, candidate: str | None = None, current: str | None = None):
        self.config = config
        self.candidate, self.current = candidate, current  # head refs (NAME@vNNNN), when known
        self.state: State = "trial"
        self.every = max(1, round(1 / config.share))
        self.arms = {"candidate": ArmStats(config.window_requests), "current": ArmStats(config.window_requests)}
        self.decision: Decision | None = None
        self._routed = 0

    @property
    def share(self) -> float:
        """The candidate's share of speculative-bound traffic in the current state."""
        return {"trial": 1 / self.every, "promoted": 1.0, "rolled_back": 0.0}[self.state]

    def route(self) -> bool:
        """Call once per request bound for the speculative deployment: True sends it to the candidate."""
        if self.state != "trial":
            return self.state == "promoted"
        self._routed += 1
        return self._routed % self.every == 0

    def view(self, arm: Arm, decision: Decision | None = None) -> CanaryView:
        c, k = self.arms["candidate"], self.arms["current"]
        return CanaryView(self.state, arm, self.share, c.replies, k.replies, _r(c.tau.mean), _r(k.tau.mean),
                          _r(c.total.rate), _r(k.total.rate),
                          decision.decision if decision else None, decision.figures if decision else None)

    def observe(self, arm: Arm, stats: AcceptanceStats | None, latency_ms: float | None = None,
                error: bool = False) -> Decision | None:
        """One request of ``arm``: its draft counts (``acceptance.reply_stats``; None: drafted nothing), the
        time of its model calls, or ``error`` when it failed. Outside the trial nothing is observed."""
        if self.state != "trial":
            return None
        self.arms[arm].add(stats, latency_ms, error)
        decision = self._rollback() or self._promote()
        if decision is not None:
            self.state = decision.state
            self.decision = decision
        return decision

    def figures(self) -> dict[str, Any]:
        c, k, cfg = self.arms["candidate"], self.arms["current"], self.config
        out: dict[str, Any] = {"candidate": c.figures(), "current": k.figures(), "margin": cfg.margin,
                               "rollback_acceptance": cfg.rollback_acceptance,
                               "max_error_increase": cfg.max_error_increase}
        tau = welch_interval(c.tau, k.tau)
        if tau is not None:
            out["tau_diff"], out["tau_diff_ci"] = _r(tau[0]), [_r(tau[1]), _r(tau[2])]
        rate = welch_interval(c.rate, k.rate)
        if rate is not None:
            out["acceptance_diff"], out["acceptance_diff_ci"] = _r(rate[0]), [_r(rate[1]), _r(rate[2])]
        lat = welch_interval(c.latency_ms, k.latency_ms)
        if lat is not None:
            out["latency_diff_ms"], out["latency_diff_ci_ms"] = _r(lat[0], 1), [_r(lat[1], 1), _r(lat[2], 1)]
        return out

    def describe(self) -> dict[str, Any]:
        """For ``/v1/info``."""
        return {"state": self.state, "share": self.share, "every": self.every, "candidate": self.candidate,
                "current": self.current, "config": self.config.model_dump(mode="json"),
                "decision": ({"decision": self.decision.decision, "reason": self.decision.reason}
                             if self.decision else None), "figures": self.figures()}

    # --- the two decisions ------------------------------------------------------------
    def _rollback(self) -> Decision | None:
        c, k, cfg = self.arms["candidate"], self.arms["current"], self.config
        if c.requests < cfg.min_rollback_requests:
            return None
        ce, ke = c.rolling_error_rate, k.rolling_error_rate
        if ce is not None and ce > (ke or 0.0) + cfg.max_error_increase:
            return Decision("rollback", "errors", self.figures())
        ca, ka = c.rolling_acceptance, k.rolling_acceptance
        if min(c.replies, k.replies) >= cfg.min_rollback_requests and ca is not None and ka is not None \
                and ca < cfg.rollback_acceptance * ka:
            return Decision("rollback", "acceptance", self.figures())
        return None

    def _promote(self) -> Decision | None:
        c, k, cfg = self.arms["candidate"], self.arms["current"], self.config
        if c.replies < cfg.min_requests or k.replies < cfg.min_requests:
            return None
        tau = welch_interval(c.tau, k.tau)
        if tau is None:
            return None
        diff, lo, _ = tau
        if lo > 0 and c.tau.mean >= (1 + cfg.margin) * k.tau.mean:
            return Decision("promote", "better", self.figures())
        return None
