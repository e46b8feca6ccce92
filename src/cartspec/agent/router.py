"""Which deployment answers a request: speculative or plain.

A strategy object fed back with what happened (like Hugging Face's candidate
generators): ``decide`` picks a target from the expected reply length and the
current load; ``observe`` updates the expected length with the reply's real
token count. Off by default: then every request goes to the speculative
deployment (or the only one there is), and the decision says so.

The acceptance fallback (``fallback.py``), when there is one, comes first:
while the draft does not pay, requests go to plain (``acceptance-fallback``)
but for the probes (``acceptance-probe``), whatever the length or load policy
would say. A deployment that is down is avoided last, whatever chose it.

A canary (``canary.py``), when there is one, acts after the router: it sends its
share of what the router sent to the speculative deployment to the candidate
(``candidate; reason=canary``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from .config import RouterConfig
from .fallback import AcceptanceFallback, FallbackView

Target = Literal["speculative", "plain", "candidate"]


@dataclass(frozen=True)
class RouteDecision:
    target: Target
    reason: str
    expected_tokens: float | None = None
    fallback: FallbackView | None = None  # the acceptance fallback when this was decided, if there is one

    def header(self) -> str:
        head = f"{self.target}; reason={self.reason}"
        if self.reason.startswith("acceptance-") and self.fallback and self.fallback.acceptance is not None:
            head += f"; acceptance={self.fallback.acceptance:.3f}"
        return head


def _bucket(query: str) -> int:
    """Longer queries ask for more fields, so replies grow with them: 0..3."""
    return min(len(query.split()) // 6, 3)


class LengthEstimator:
    """Expected reply tokens per (task, query-length bucket): an EMA of observed lengths."""

    def __init__(self, prior: dict[str, float], alpha: float):
        self.prior = prior
        self.alpha = alpha
        self._ema: dict[tuple[str, int], float] = {}

    def expect(self, task: str, query: str) -> float:
        return self._ema.get((task, _bucket(query)), self.prior.get(task, 64.0))

    def observe(self, task: str, query: str, tokens: int) -> None:
        key = (task, _bucket(query))
        old = self._ema.get(key, self.prior.get(task, 64.0))
        self._ema[key] = (1 - self.alpha) * old + self.alpha * tokens


class Router:
    def __init__(self, config: RouterConfig, targets: set[str], fallback: AcceptanceFallback | None = None):
        self.config = config
        self.targets = targets
        self.lengths = LengthEstimator(config.prior_tokens, config.ema_alpha)
        self.fallback = fallback if len(targets) > 1 else None

    def decide(self, task: str, query: str, speculative_inflight: int, up: dict[str, bool]) -> RouteDecision:
        """``up``: which targets are currently healthy (a down target is only chosen if nothing else is)."""
        if len(self.targets) == 1:
            only = next(iter(self.targets))
            return RouteDecision(only, "only-deployment")  # type: ignore[arg-type]
        fb = self.fallback.route() if self.fallback else None
        if fb is not None and fb.state == "fallback":
            preferred = RouteDecision("speculative", "acceptance-probe", fallback=fb) if fb.probe \
                else RouteDecision("plain", "acceptance-fallback", fallback=fb)
        else:
            preferred = replace(self._preferred(task, query, speculative_inflight), fallback=fb)
        if not up.get(preferred.target, True):
            other: Target = "plain" if preferred.target == "speculative" else "speculative"
            if up.get(other, False):
                return RouteDecision(other, f"failover-{preferred.target}-down", preferred.expected_tokens, fb)
        return preferred

    def _preferred(self, task: str, query: str, speculative_inflight: int) -> RouteDecision:
        c = self.config
        if not c.enabled:
            return RouteDecision("speculative", "router-off")
        expected = self.lengths.expect(task, query)
        if c.policy in ("load", "length+load") and speculative_inflight >= c.max_speculative_inflight:
            return RouteDecision("plain", "load", expected)
        if c.policy in ("length", "length+load") and expected <= c.short_reply_tokens:
            return RouteDecision("plain", "short-reply", expected)
        return RouteDecision("speculative", "long-reply" if c.policy != "load" else "light-load", expected)

    def observe(self, task: str, query: str, output_tokens: int) -> None:
        if output_tokens > 0:
            self.lengths.observe(task, query, output_tokens)
