"""Typed service settings, kept in a YAML/TOML/JSON file like a ``DeploymentSpec``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config_files import FileModel
from ..task.data import MAX_HISTORY_TURNS, MAX_QUERY_CHARS
from ..task.traffic import TrafficConfig


class CacheConfig(BaseModel):
    """Hot cache of replies to repeated, normalised requests."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    max_entries: int = Field(4096, ge=1)
    ttl_s: float = Field(600.0, gt=0, description="a cached reply older than this is asked again")
    max_history_turns: int = Field(4, ge=0, description="longer conversations are rarely repeated: not cached")
    openai: bool = Field(False, description="also cache /v1/chat/completions and /v1/completions replies at "
                         "temperature 0, not streamed, keyed by the exact request (off: a client's requests are "
                         "its own, and a chat is rarely repeated word for word)")


class RouterConfig(BaseModel):
    """Speculative vs plain deployment per request. Off: everything goes to the speculative one.

    Why route at all: on a CPU the draft's cost grows with the batch (a head that
    drafts nothing useful costs more at a batch of 8 than at one stream: the
    generic head's row in docs/archive/experiments-2026-11.md, "Paper preset, session 3"), and a
    short reply leaves few tokens for the draft to win back its cost.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    policy: Literal["length", "load", "length+load"] = "length+load"
    short_reply_tokens: int = Field(32, ge=0, description="expected reply at or under this -> plain")
    max_speculative_inflight: int = Field(8, ge=1, description="at or over this many in flight -> plain")
    prior_tokens: dict[str, float] = Field(default_factory=lambda: {"search": 40.0, "support": 70.0},
                                           description="expected reply tokens before anything is observed")
    ema_alpha: float = Field(0.1, gt=0, le=1, description="weight of each observed reply length")


class FallbackConfig(BaseModel):
    """Acceptance fallback ("rollback") between the speculative and the plain deployment.

    A draft head that stops matching the target (a new adapter, drifted traffic)
    makes speculation slower than none: a head trained for the base model accepts
    few of its drafts on the fine-tuned commerce model and runs under the baseline
    (the generic head in docs/drafting.md and docs/archive/experiments-2026-11.md, "Paper preset,
    session 3", with the command and the machine). The agent keeps a rolling acceptance rate
    (accepted / drafted tokens over the last ``window_requests`` speculative
    replies); below ``threshold`` it routes to the plain deployment and sends
    every k-th request (k = 1 / ``probe_share``) to the speculative one as a
    probe; once the probes' rolling rate is above ``recover_threshold`` it
    routes there again. The gap between the two thresholds keeps a rate that
    hovers near one of them from switching back and forth.

    ``enabled``: None (default) turns it on exactly when the agent has both a
    speculative and a plain deployment; with one there is nothing to fall back to.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = None
    threshold: float = Field(0.3, ge=0, le=1, description="rolling acceptance under this -> fallback")
    recover_threshold: float = Field(0.5, ge=0, le=1, description="probes' rolling acceptance over this -> back")
    window_requests: int = Field(32, ge=1, description="replies in the rolling window (token-weighted rate)")
    min_requests: int = Field(8, ge=1, description="replies with drafts needed before either switch")
    probe_share: float = Field(0.1, gt=0, le=1, description="share of fallback traffic sent as probes")

    @model_validator(mode="after")
    def _check(self) -> "FallbackConfig":
        if self.recover_threshold <= self.threshold:
            raise ValueError("recover_threshold must be above threshold (hysteresis)")
        if self.min_requests > self.window_requests:
            raise ValueError("min_requests must be <= window_requests")
        return self


class AdmissionConfig(BaseModel):
    """Admission control: refuse at once what would wait too long, instead of queueing it.

    Off by default. On, a request that reaches the model (cache hits never do)
    is answered 503 ``overloaded`` with ``Retry-After`` when its expected
    latency at the chosen deployment is over ``max_wait_s``. The estimate is
    Little's law over observed completions: with L model calls queued and in
    flight there and lambda calls completed per busy second (last
    ``window_completions`` completions within ``window_s``), a new request
    takes about (L + 1) / lambda (``admission.py``). Admitted requests then
    take about ``max_wait_s`` at worst when the deployment is saturated, so
    set it at or a little under the latency SLO, and above twice the latency
    of a single request. Without it, an overloaded deployment answers every
    request late instead of refusing some (the admission drill in
    docs/serving.md, "Two deployments, acceptance fallback, admission control").
    A deployment with nothing queued or in flight always admits, and so does
    one with too few completions to measure (``min_completions``).
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    max_wait_s: float = Field(2.0, gt=0, description="expected queue + service time bound (the latency SLO)")
    retry_after_s: float = Field(1.0, ge=0, description="the least Retry-After a refusal says")
    window_completions: int = Field(32, ge=2, description="completions the throughput is measured over")
    window_s: float = Field(30.0, gt=0, description="completions older than this are forgotten")
    min_completions: int = Field(4, ge=2, description="fewer in the window: no estimate, admit")

    @model_validator(mode="after")
    def _check(self) -> "AdmissionConfig":
        if self.min_completions > self.window_completions:
            raise ValueError("min_completions must be <= window_completions")
        return self


class CanaryConfig(BaseModel):
    """Canary of a candidate draft head beside the current one (``canary.py``).

    The candidate is the same target with another head, so replies do not change;
    only acceptance and latency can. In trial every k-th request bound for the
    speculative deployment (k = round(1 / ``share``)) goes to the candidate. It is
    promoted (all speculative traffic, and the head registry's ``current`` when it
    is a registry version) once it has ``min_requests`` replies that drafted and
    its mean per-request τ is at least (1 + ``margin``) × the current head's, with
    the 95% interval of the difference above 0. It is rolled back at once (no more
    traffic; the registry marks the version rejected) when, after
    ``min_rollback_requests``, its rolling acceptance falls under
    ``rollback_acceptance`` × the current head's or its error rate rises above the
    current's by more than ``max_error_increase``.

    ``head``: the candidate (a registry ref ``NAME@vNNNN``, ``NAME`` for that
    registry's newest candidate, or a head directory); ``cartspec serve`` starts
    it beside the main deployment (``--canary-head`` overrides it).
    """

    model_config = ConfigDict(extra="forbid")

    head: str | None = Field(None, description="the candidate head: NAME@vNNNN, NAME (newest candidate) or a path")
    share: float = Field(0.1, gt=0, le=0.5, description="share of speculative-bound traffic sent to the candidate")
    min_requests: int = Field(50, ge=2, description="candidate replies that drafted, needed before promotion")
    margin: float = Field(0.05, ge=0, description="promote at candidate τ >= (1 + margin) × current τ")
    rollback_acceptance: float = Field(0.8, gt=0, le=1, description="roll back under this × current's "
                                       "rolling acceptance")
    min_rollback_requests: int = Field(20, ge=1, description="candidate requests needed before a rollback")
    max_error_increase: float = Field(0.05, ge=0, le=1, description="roll back when the candidate's error rate "
                                      "is over the current's by more than this")
    window_requests: int = Field(50, ge=1, description="requests in the rolling acceptance and error windows")
    registry: bool = Field(True, description="write promote / reject to the head registry when the candidate "
                                             "is a registry version")

    @model_validator(mode="after")
    def _check(self) -> "CanaryConfig":
        if self.min_rollback_requests > self.window_requests:
            raise ValueError("min_rollback_requests must be <= window_requests")
        return self


class AgentConfig(FileModel):
    """Everything the agent service needs besides its upstream deployments."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    api_key: str | None = Field(None, description="when set, /v1/* and /metrics need 'Authorization: Bearer KEY' "
                                "or 'X-API-Key' (`serve --api-key-env VAR` reads it from a variable instead)")
    structured_outputs: bool = Field(True, description="constrain every reply with vLLM's JSON-schema decoding")
    retry_unparsable: bool = Field(True, description="one constrained retry when a reply does not parse")
    temperature: float = Field(0.0, ge=0, le=2)
    max_tokens: dict[str, int] = Field(default_factory=lambda: {"search": 160, "support": 256})
    upstream_timeout_s: float = Field(30.0, gt=0, description="one model call; past it -> 504")
    request_timeout_s: float = Field(60.0, gt=0, description="a whole request, retries and queue included")
    max_inflight: int = Field(64, ge=1, description="model calls in flight per deployment; more wait in queue")
    max_queue: int = Field(1024, ge=0, description="waiting beyond this -> 503 overloaded")
    probe_interval_s: float = Field(1.0, gt=0, description="health checks of a deployment that is down")
    max_body_bytes: int = Field(64 * 1024, ge=1024, description="a larger body -> 413 body_too_large")
    max_query_chars: int = Field(MAX_QUERY_CHARS, ge=1, description="a longer query -> 422 query_too_long; at most "
                                 f"{MAX_QUERY_CHARS}, what the model's request format takes")
    max_history_turns: int = Field(MAX_HISTORY_TURNS, ge=0, description="more turns -> 422 malformed_history; at "
                                   f"most {MAX_HISTORY_TURNS}, what the model's request format takes")
    trace_path: Path | None = Field(None, description="JSONL, one line per request; None: no trace")
    trace_max_bytes: int = Field(256 * 1024 * 1024, description="rotated to .1 past this size")
    cache: CacheConfig = Field(default_factory=CacheConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    fallback: FallbackConfig = Field(default_factory=FallbackConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    canary: CanaryConfig = Field(default_factory=CanaryConfig)
    traffic: TrafficConfig = Field(default_factory=TrafficConfig)

    @model_validator(mode="after")
    def _check(self) -> "AgentConfig":
        if self.request_timeout_s < self.upstream_timeout_s:
            raise ValueError("request_timeout_s must be >= upstream_timeout_s")
        for task in ("search", "support"):
            if task not in self.max_tokens:
                raise ValueError(f"max_tokens needs an entry for {task!r}")
        # Refused here rather than per request: a limit past the request format's would let requests through
        # that the model's request type then refuses (``task.data.Request``).
        if self.max_query_chars > MAX_QUERY_CHARS:
            raise ValueError(f"max_query_chars {self.max_query_chars} is over what the model takes: a query is at "
                             f"most {MAX_QUERY_CHARS} characters; set max_query_chars to {MAX_QUERY_CHARS} or less")
        if self.max_history_turns > MAX_HISTORY_TURNS:
            raise ValueError(f"max_history_turns {self.max_history_turns} is over what the model takes: a history is "
                             f"at most {MAX_HISTORY_TURNS} turns; set max_history_turns to {MAX_HISTORY_TURNS} or less")
        return self

    def public(self) -> dict:
        """The settings as /v1/info shows them: never a key (the API key, the traffic pseudonyms' key)."""
        out = self.model_dump(mode="json", exclude={"api_key": True, "traffic": {"redact_key"}})
        out["traffic"]["redact_key_set"] = self.traffic.redact_key is not None
        return out | {"api_key_set": self.api_key is not None}
