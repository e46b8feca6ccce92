"""Prometheus metrics of one agent app, in its own registry (two apps in one
process, as in tests, never share counters).

Acceptance is defined once (``cartspec.results.AcceptanceStats``): rate = accepted / proposed
draft tokens; τ = 1 + accepted / drafts (verify steps). Both come from vLLM's
per-request speculative metrics, summed per deployment, so they describe exactly
the traffic this agent sent, not the server's lifetime.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily

from .acceptance import AcceptanceStats, pooled

LATENCY_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 20.0, 30.0, 60.0)


class AgentMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "cartspec_agent_"
        self.requests = Counter(p + "requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram(p + "request_seconds", "End-to-end latency per endpoint (all statuses)",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.stage = Histogram(p + "stage_seconds", "Time per stage of answered model calls: queue, upstream, parse",
                               ["endpoint", "stage"], buckets=LATENCY_BUCKETS, registry=r)
        self.cache = Counter(p + "cache", "Cache lookups: hit, miss, coalesced (waited for an identical "
                             "request in flight), bypass, off", ["endpoint", "result"], registry=r)
        self.cache_entries = Gauge(p + "cache_entries", "Replies held in the hot cache", registry=r)
        self.routes = Counter(p + "route_decisions", "Router decisions: target deployment and why",
                              ["endpoint", "target", "reason"], registry=r)
        self.attempts = Counter(p + "model_attempts", "Model calls by attempt (1 = first, 2 = constrained retry) "
                                "and outcome", ["endpoint", "attempt", "outcome"], registry=r)
        self.upstream_errors = Counter(p + "upstream_errors", "Failed or refused model calls",
                                       ["target", "kind"], registry=r)
        self.upstream_up = Gauge(p + "upstream_up", "1 when the deployment answers its health check",
                                 ["target"], registry=r)
        self.inflight = Gauge(p + "upstream_inflight", "Model calls in flight", ["target"], registry=r)
        self.output_tokens = Counter(p + "output_tokens", "Tokens generated for answered requests",
                                     ["target"], registry=r)
        self.drafts = Counter(p + "spec_drafts", "Verify steps with a draft (vLLM per-request metrics)",
                              ["target"], registry=r)
        self.draft_tokens = Counter(p + "spec_draft_tokens", "Draft tokens proposed", ["target"], registry=r)
        self.accepted_tokens = Counter(p + "spec_accepted_tokens", "Draft tokens accepted", ["target"], registry=r)
        self.acceptance_rate = Gauge(p + "spec_acceptance_rate", "Accepted / proposed draft tokens, "
                                     "since start", ["target"], registry=r)
        self.acceptance_length = Gauge(p + "spec_acceptance_length", "τ = 1 + accepted / drafts, since start",
                                       ["target"], registry=r)
        self.request_tau = Histogram(p + "spec_request_acceptance_length", "τ of each answered request",
                                     ["target"], buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0),
                                     registry=r)
        self.build = Info(p + "deployment", "What runs behind each target", ["target"], registry=r)
        self.fallback_switches = Counter(p + "fallback_switches", "Acceptance fallback switches: to_fallback "
                                         "(route to plain, probe) or to_speculative (recovered)",
                                         ["target", "direction"], registry=r)
        self.fallback_state = Gauge(p + "fallback_state", "1 while the acceptance fallback routes away from "
                                    "this speculative target, 0 while it serves", ["target"], registry=r)
        self.rolling_acceptance = Gauge(p + "fallback_rolling_acceptance", "Accepted / drafted tokens over the "
                                        "fallback's window (NaN before any draft)", ["target"], registry=r)
        self.rolling_observed = Gauge(p + "fallback_window_requests", "Replies in the fallback's window",
                                      ["target"], registry=r)
        self.admission_rejected = Counter(p + "admission_rejected", "Requests refused with 503 overloaded "
                                          "because their expected latency was over the bound",
                                          ["endpoint", "target"], registry=r)
        self.expected_latency = Gauge(p + "admission_expected_seconds", "Admission control's expected latency "
                                      "of a request arriving now (NaN while not measured)", ["target"], registry=r)
        c = "cartspec_canary_"
        self.canary_decisions = Counter(c + "decisions", "Canary decisions on the candidate head: promote "
                                        "(all speculative traffic to it) or rollback (none)", ["decision"],
                                        registry=r)
        self.canary_share = Gauge(c + "share", "The candidate head's share of speculative-bound traffic",
                                  registry=r)
        self.canary_state = Gauge(c + "state", "1 for the canary's state (trial, promoted, rolled_back), 0 for "
                                  "the others", ["state"], registry=r)
        self.canary_requests = Gauge(c + "replies", "Replies that drafted, per arm (candidate or current head), "
                                     "in the trial", ["arm"], registry=r)
        self.canary_tau = Gauge(c + "tau", "Mean per-request τ per arm in the trial (NaN before any)", ["arm"],
                                registry=r)
        self.canary_acceptance = Gauge(c + "acceptance", "Accepted / proposed draft tokens per arm in the trial "
                                       "(NaN before any)", ["arm"], registry=r)
        self.canary_errors = Counter(c + "errors", "Failed requests per arm in the trial", ["arm"], registry=r)
        self._sums: dict[str, AcceptanceStats] = {}
        self.engine_steps = EngineSteps()
        r.register(self.engine_steps)

    def observe_spec(self, target: str, stats: AcceptanceStats | None) -> None:
        """One reply's draft counts (``acceptance.reply_stats``); None: it drafted nothing."""
        if stats is None:
            return
        self.drafts.labels(target).inc(stats.steps)
        self.draft_tokens.labels(target).inc(stats.drafted)
        self.accepted_tokens.labels(target).inc(stats.accepted)
        total = self._sums[target] = pooled([self._sums.get(target, AcceptanceStats()), stats])
        if total.rate is not None:
            self.acceptance_rate.labels(target).set(total.rate)
        if total.tau is not None:
            self.acceptance_length.labels(target).set(total.tau)
        if stats.tau is not None:
            self.request_tau.labels(target).observe(stats.tau)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineSteps:
    """The engine's own step times, per target started here: read from the file cartspec's vLLM plugin writes
    (``vllm_plugin.steps``) at every scrape, exported as counters since the engine started (a restarted
    engine starts them again). ``rate(...draft_seconds) / rate(...steps)`` is the drafting time per step."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}

    def watch(self, target: str, path: str) -> None:
        self.files[target] = path

    def collect(self):
        from ..vllm_plugin import steps

        p = "cartspec_agent_engine_"
        fams = {"steps": CounterMetricFamily(p + "steps", "Engine steps (the target's forward, sampling, the "
                                             "next draft) by batch size (requests in the step)",
                                             labels=["target", "batch"]),
                "draft_s": CounterMetricFamily(p + "draft_seconds", "Engine time spent drafting (the head's "
                                               "forwards and cartspec's drafters), by batch size",
                                               labels=["target", "batch"]),
                "verify_s": CounterMetricFamily(p + "verify_seconds", "Engine time spent on the rest of each step "
                                                "(the target's forward over the drafts, sampling, verification), "
                                                "by batch size", labels=["target", "batch"]),
                "gc_s": CounterMetricFamily(p + "gc_seconds", "Engine time spent in Python's garbage collector "
                                            "(part of the drafting and verifying seconds), by batch size",
                                            labels=["target", "batch"]),
                "tokens": CounterMetricFamily(p + "step_tokens", "Tokens the target ran in those steps, by batch "
                                              "size", labels=["target", "batch"]),
                "prompt_tokens": CounterMetricFamily(p + "step_prompt_tokens", "Of those tokens, the prompts' "
                                                     "prefill (work that speculation does not shorten), by batch "
                                                     "size", labels=["target", "batch"]),
                "decode_steps": CounterMetricFamily(p + "decode_steps", "Of those steps, the ones that prefilled "
                                                    "no prompt (decoding alone), by batch size",
                                                    labels=["target", "batch"]),
                "decode_s": CounterMetricFamily(p + "decode_seconds", "Engine time spent in those decoding steps, "
                                                "by batch size", labels=["target", "batch"]),
                "prompts": CounterMetricFamily(p + "prompts", "Requests whose prompt entered a step, by batch "
                                               "size", labels=["target", "batch"])}
        for target, path in self.files.items():
            for bucket, row in steps.read(path).items():
                for field, fam in fams.items():
                    fam.add_metric([target, bucket], float(row.get(field, 0.0)))
        yield from fams.values()
