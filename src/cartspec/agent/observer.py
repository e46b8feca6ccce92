"""Where every model call reports: one ``CallObserver`` keeps the agent's books on it.

The agent asks the model, the retry policy (``retry``) says what follows, and the observer records it: a call's
time and the engine's steps while it ran (the answer's timing, the trace record, the metrics), a failed call,
a reply's parse time, each attempt's outcome (the attempts metric, and the router's length estimate from the
reply that answers), the acceptance fallback's window (a switch is counted and logged) and, per request of a
canary arm, the canary's counts (a decision is acted on: metrics, a log line, the head registry).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ..serving.client import Completion, UpstreamError
from ..vllm_plugin import steps as engine_steps
from .acceptance import reply_stats
from .canary import Arm, Canary, Decision
from .chat import ChatCall
from .fallback import AcceptanceFallback, Switch
from .metrics import AgentMetrics
from .router import Router
from .trace import CanaryTrace, EngineTrace, SpecTrace, TraceRecord
from .upstream import Upstream, Upstreams, UpstreamUnavailable

if TYPE_CHECKING:
    from .app import Answer

log = logging.getLogger("cartspec.agent")


def speculative_target(canary: Canary | None) -> str:
    """Who drafts for speculative-bound traffic: the candidate once promoted, else the speculative one."""
    return "candidate" if canary is not None and canary.state == "promoted" else "speculative"


def canary_arm(canary: Canary | None, target: str) -> Arm | None:
    """The canary arm a call to ``target`` is one of; None without a canary or for the plain deployment."""
    if canary is None or target not in ("speculative", "candidate"):
        return None
    return "candidate" if target == "candidate" else "current"


class CallObserver:
    """The bookkeeping after each model call, composed of the agent's metrics, router, acceptance fallback and
    canary (each may be off: None)."""

    def __init__(self, metrics: AgentMetrics, router: Router, fallback: AcceptanceFallback | None,
                 canary: Canary | None, upstreams: Upstreams):
        self.metrics, self.router, self.fallback, self.canary = metrics, router, fallback, canary
        self.upstreams = upstreams

    # --- one model call ------------------------------------------------------------------
    @staticmethod
    def engine_steps(up: Upstream) -> Any:
        """The deployment's engine step counters now (None when it writes none): a call's ``steps_before``."""
        return engine_steps.read(up.step_stats) if up.step_stats else None

    def on_error(self, target: str, exc: UpstreamUnavailable | UpstreamError, ans: Answer, t0: float) -> None:
        """A call the deployment failed (``t0``: when it began): counted by kind; a failed call's wait counts."""
        if isinstance(exc, UpstreamUnavailable):
            self.metrics.upstream_errors.labels(target, "down").inc()
            return
        kind = {0: "unreachable", 504: "timeout"}.get(exc.status, f"http_{exc.status}")
        self.metrics.upstream_errors.labels(target, kind).inc()
        ans.timing.upstream_ms += (time.perf_counter() - t0) * 1000

    def on_result(self, endpoint: str, rec: TraceRecord, ans: Answer, target: str, up: Upstream, comp: Completion,
                  call_s: float, queued: float, steps_before: Any) -> None:
        """One finished call into the answer, its trace, the metrics and the acceptance fallback."""
        ans.model_ms += call_s * 1000
        ans.timing.queue_ms += queued * 1000
        ans.timing.upstream_ms += (call_s - queued) * 1000
        engine = (comp.raw.get("metrics") or {}) if comp.raw else {}
        if engine.get("queue_time_ms") is not None:
            ans.timing.engine_queue_ms = engine["queue_time_ms"]
        if engine.get("time_to_first_token_ms") is not None:
            ans.timing.engine_ttft_ms = engine["time_to_first_token_ms"]
        self.metrics.stage.labels(endpoint, "queue").observe(queued)
        self.metrics.stage.labels(endpoint, "upstream").observe(call_s - queued)
        rec.output_tokens, rec.finish_reason = comp.output_tokens, comp.finish_reason
        rec.spec = SpecTrace.from_vllm(comp.request_spec_metrics)
        if steps_before is not None:  # the engine's steps while this call ran (shared with the calls beside it)
            rec.engine = EngineTrace.of(engine_steps.difference(engine_steps.read(up.step_stats), steps_before))
        self.metrics.output_tokens.labels(target).inc(comp.output_tokens)
        ans.last_stats = reply_stats(comp.request_spec_metrics)
        self.metrics.observe_spec(target, ans.last_stats)
        if self.fallback is not None and target == speculative_target(self.canary):
            switch = self.fallback.observe(ans.last_stats)
            if switch is not None:
                self.switched(switch)

    def on_parse(self, endpoint: str, ans: Answer, parse_s: float) -> None:
        """The time reading one reply took."""
        ans.timing.parse_ms += parse_s * 1000
        self.metrics.stage.labels(endpoint, "parse").observe(parse_s)

    def on_attempt(self, endpoint: str, call: ChatCall, number: int, outcome: str, output_tokens: int,
                   answered: bool) -> None:
        """An attempt's outcome (valid, cut, repaired, unparsable; a stream's: valid, cut, invalid); ``answered``:
        its reply is the answer as it stands, whose length the router learns from."""
        self.metrics.attempts.labels(endpoint, str(number), outcome).inc()
        if answered:
            self.router.observe(call.task, call.route_text, output_tokens)

    # --- the acceptance fallback ------------------------------------------------------------
    def switched(self, switch: Switch) -> None:
        self.metrics.fallback_switches.labels("speculative", switch.direction).inc()
        level = logging.WARNING if switch.to == "fallback" else logging.INFO
        log.log(level, "%s (target speculative: %s; plain: %s)", switch.describe(),
                self.upstreams["speculative"].label, self.upstreams["plain"].label)

    # --- the canary -------------------------------------------------------------------------
    def on_request(self, target: str, ans: Answer, rec: TraceRecord, error: bool = False) -> None:
        """A request answered by (or failed at, ``error``) ``target``, counted for its canary arm if it is one."""
        arm = canary_arm(self.canary, target)
        if arm is not None:
            self.canary_observe(arm, ans, rec, error)

    def canary_observe(self, arm: Arm, ans: Answer, rec: TraceRecord, error: bool = False) -> None:
        """One request of an arm, answered or failed (``error``); a decision it causes is acted on here and
        stays on the request's trace line and header, whoever answers it in the end."""
        canary = self.canary
        was_trial = canary.state == "trial"
        decision = canary.observe(arm, None if error else ans.stats, None if error else ans.model_ms, error)
        if error and was_trial:
            self.metrics.canary_errors.labels(arm).inc()
        if decision is not None:
            ans.canary_decision = decision
        rec.canary = CanaryTrace(**asdict(canary.view(arm, ans.canary_decision)))
        if decision is not None:
            self.canary_decided(decision)

    def canary_decided(self, decision: Decision) -> None:
        """Metrics, a log line with the figures, and the head registry: a restart serves what was decided."""
        canary = self.canary
        self.metrics.canary_decisions.labels(decision.decision).inc()
        level = logging.INFO if decision.decision == "promote" else logging.WARNING
        log.log(level, "%s (candidate %s: %s; current %s: %s) figures %s", decision.describe(),
                canary.candidate or "head", self.upstreams["candidate"].label, canary.current or "head",
                self.upstreams["speculative"].label, json.dumps(decision.figures, sort_keys=True))
        if not canary.config.registry or not canary.candidate:
            return
        try:
            from ..model.heads import HeadRegistry, parse_ref

            name, version = parse_ref(canary.candidate)
            registry = HeadRegistry(name)
            reason = f"canary: {decision.describe()}"
            figures = {"canary": decision.figures, "current": canary.current}
            if decision.decision == "promote":
                registry.promote(version, reason=reason, figures=figures)
            else:
                registry.reject(version, reason=reason, figures=figures)
            log.info("head registry %s: %s %s", name, "promoted" if decision.decision == "promote" else "rejected",
                     canary.candidate)
        except Exception:  # the decision stands for this process; the registry is told by hand
            log.exception("canary %s of %s not written to the head registry: run `cartspec heads %s` by hand",
                          decision.decision, canary.candidate,
                          f"promote {canary.candidate}" if decision.decision == "promote" else "list")
