"""Acceptance fallback: stop speculating where the draft stopped paying, and come back when it pays again.

A strategy object fed back with what was accepted, like the router it sits in:
``route()`` per routed request (in fallback: a probe or not), ``observe()`` per
speculative reply. Two states::

    speculative --(rolling acceptance < threshold, >= min_requests replies)--> fallback
    fallback    --(probes' rolling acceptance > recover_threshold, >= min_requests)--> speculative

In fallback every k-th request (k = round(1 / probe_share)) still goes to the
speculative deployment: a counter, not a coin, so a run is reproducible. The
window restarts on entering fallback, so recovery is judged on replies that
finish after the switch, never on the ones that caused it. Side effects (metrics,
logs) are the caller's: ``observe`` returns the ``Switch`` it made.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from .acceptance import AcceptanceStats, pooled
from .config import FallbackConfig

State = Literal["speculative", "fallback"]


@dataclass(frozen=True)
class FallbackView:
    """The fallback as one request was routed by it: goes into its trace line and headers."""

    state: State
    acceptance: float | None  # AcceptanceFallback.rate when the request was routed; None before any draft
    observed: int             # replies in the window
    probe: bool = False


@dataclass(frozen=True)
class Switch:
    to: State
    acceptance: float
    threshold: float
    observed: int

    @property
    def direction(self) -> str:
        return f"to_{self.to}"

    def describe(self) -> str:
        if self.to == "fallback":
            return (f"acceptance fallback: rolling acceptance {self.acceptance:.3f} < threshold {self.threshold:.3f} "
                    f"over {self.observed} speculative replies; routing to the plain deployment, probing")
        return (f"acceptance recovered: probes' rolling acceptance {self.acceptance:.3f} > recover_threshold "
                f"{self.threshold:.3f} over {self.observed} replies; routing to the speculative deployment again")


class AcceptanceWindow:
    """Accepted / drafted tokens over the last ``size`` replies that drafted."""

    def __init__(self, size: int):
        self._items: deque[AcceptanceStats] = deque(maxlen=size)

    def add(self, stats: AcceptanceStats) -> None:
        self._items.append(stats)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def rate(self) -> float | None:
        return pooled(self._items).rate


class AcceptanceFallback:
    def __init__(self, config: FallbackConfig):
        self.config = config
        self.state: State = "speculative"
        self.window = AcceptanceWindow(config.window_requests)
        self.probe_every = max(1, round(1 / config.probe_share))
        self._routed_in_fallback = 0
        self._switch_rate: float | None = None

    @property
    def rate(self) -> float | None:
        """The rolling acceptance; right after a switch to fallback, before any probe, the rate that caused it."""
        return self.window.rate if len(self.window) else self._switch_rate

    def view(self, probe: bool = False) -> FallbackView:
        return FallbackView(self.state, self.rate, len(self.window), probe)

    def route(self) -> FallbackView:
        """Call once per routed request; in fallback, ``probe`` marks the ones for the speculative deployment."""
        if self.state == "speculative":
            return self.view()
        self._routed_in_fallback += 1
        return self.view(probe=self._routed_in_fallback % self.probe_every == 0)

    def observe(self, stats: AcceptanceStats | None) -> Switch | None:
        """A speculative reply's draft counts (``acceptance.reply_stats``); None: it drafted nothing."""
        if stats is None or stats.rate is None:
            return None
        self.window.add(stats)
        rate, n, c = self.window.rate, len(self.window), self.config
        if rate is None or n < c.min_requests:
            return None
        if self.state == "speculative" and rate < c.threshold:
            self.state = "fallback"
            self.window.clear()
            self._routed_in_fallback = 0
            self._switch_rate = rate
            return Switch("fallback", rate, c.threshold, n)
        if self.state == "fallback" and rate > c.recover_threshold:
            self.state = "speculative"
            return Switch("speculative", rate, c.recover_threshold, n)
        return None
