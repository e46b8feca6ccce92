"""Admission control: refuse at once what would wait past the bound, instead of making everyone late.

Per deployment the agent knows how many model calls wait for a slot (queued)
and how many run (in flight), and it sees calls complete. Little's law,
L = lambda x W, turned around: a new request joins an occupancy of L + 1 and,
at throughput lambda, spends about (L + 1) / lambda there: queued / lambda
waiting for a slot, (in flight + 1) / lambda in service (which includes vLLM's
own queue and batching, so the estimate needs no model of the engine). lambda
is measured per *busy* second, so a lightly used deployment is not mistaken
for a slow one.

Exact for a saturated engine, where throughput no longer grows with the
batch: the regime admission exists for. Below saturation one more request
costs less than a whole 1 / lambda, so the estimate errs on the safe side; a
deployment whose single reply takes more than half of ``max_wait_s`` is then
held to about one request at a time (refusals say so): choose the bound above
twice the single-request latency.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from .config import AdmissionConfig


class Throughput:
    """Model calls completed per busy second (one or more calls in flight), over a sliding window."""

    def __init__(self, window: int = 32, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._stamps: deque[tuple[float, float]] = deque(maxlen=window)  # (clock, busy seconds so far)
        self._busy = 0.0
        self._active = 0
        self._since = 0.0

    def begin(self) -> None:
        if self._active == 0:
            self._since = self._clock()
        self._active += 1

    def end(self, completed: bool = True) -> None:
        """``completed``: it produced a reply; a refused or failed call is no measure of throughput."""
        now = self._clock()
        self._active -= 1
        if self._active == 0:
            self._busy += now - self._since
        if completed:
            self._stamps.append((now, self.busy_s(now)))

    def busy_s(self, now: float | None = None) -> float:
        now = self._clock() if now is None else now
        return self._busy + (now - self._since if self._active else 0.0)

    def rate(self, min_completions: int = 2) -> float | None:
        """Completions per busy second since the oldest one in the window; None while too few."""
        now = self._clock()
        while self._stamps and self._stamps[0][0] < now - self.window_s:
            self._stamps.popleft()
        if len(self._stamps) < max(2, min_completions):
            return None
        # Busy time up to now, not to the last completion: a deployment that stalls measures slower at once.
        span = self.busy_s(now) - self._stamps[0][1]
        return (len(self._stamps) - 1) / span if span > 0 else None


@dataclass(frozen=True)
class Estimate:
    queued: int
    inflight: int
    rate: float | None  # completions per busy second; None: not measured yet

    @property
    def wait_s(self) -> float | None:
        return self.queued / self.rate if self.rate else None

    @property
    def service_s(self) -> float | None:
        return (self.inflight + 1) / self.rate if self.rate else None

    @property
    def expected_s(self) -> float | None:
        return (self.queued + self.inflight + 1) / self.rate if self.rate else None


@dataclass(frozen=True)
class Verdict:
    admit: bool
    estimate: Estimate
    retry_after_s: int = 0
    reason: str = ""


class Admission:
    def __init__(self, config: AdmissionConfig):
        self.config = config

    def estimate(self, queued: int, inflight: int, throughput: Throughput) -> Estimate:
        return Estimate(queued, inflight, throughput.rate(self.config.min_completions))

    def check(self, est: Estimate, deployment: str = "the deployment") -> Verdict:
        c = self.config
        if est.queued + est.inflight == 0 or est.expected_s is None:  # idle, or nothing measured: admit
            return Verdict(True, est)
        if est.expected_s <= c.max_wait_s:
            return Verdict(True, est)
        # The excess drains at the measured rate: asking back sooner would only be refused again.
        retry = max(1, math.ceil(max(c.retry_after_s, est.expected_s - c.max_wait_s)))
        reason = (f"overloaded: a request to {deployment} would take about {est.expected_s:.1f}s "
                  f"(wait {est.wait_s:.1f}s behind {est.queued} queued + service {est.service_s:.1f}s beside "
                  f"{est.inflight} in flight, at {est.rate:.2f} completions/s), over the {c.max_wait_s:g}s "
                  f"bound; retry in {retry}s")
        return Verdict(False, est, retry, reason)
