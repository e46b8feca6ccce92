"""The agent's HTTP API.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``: OpenAI's API (``openai_api``)
``POST /v1/search``  {query, history?} -> SearchParams (every field, typed)
``POST /v1/support`` {query, history?} -> SupportReply
Both kinds make the same call (``chat.ChatCall``): the commerce endpoints build the task's messages and schema.
``GET /health`` (liveness, with upstream state), ``GET /ready`` (503 while no
deployment answers), ``GET /metrics`` (Prometheus), ``GET /v1/info`` (what runs).
With an API key set, /v1/* and /metrics require it; /health and /ready stay open
for probes. None of them shows a key, a spec's env or engine flags, or a URL's
credentials (``Upstream.public``, ``serving.urls.redact_url``).

Every error is ``{"error": {"type", "reason", "request_id"}}`` with a 4xx for
what the caller can fix and a 5xx for what the deployment did; with admission
control on, 503 ``overloaded`` (and ``Retry-After``) for a request that would
wait past the bound. No error quotes the request: a reason says where and what
(a position, a code point, a count), never the text, and so do the trace and the log. Each request writes one trace line and updates the
metrics, whatever its outcome. Headers: ``X-Cartspec-Route`` (target; reason,
e.g. ``plain; reason=acceptance-fallback; acceptance=0.012``),
``X-Cartspec-Deployment``, ``X-Cartspec-Cache``, ``Server-Timing``, and with a canary
``X-Cartspec-Canary`` (e.g. ``candidate; state=trial; n=37``). With a traffic
directory, each request the model answered is also appended to the traffic log
(``task.traffic``), after its response is sent.

``create_app`` builds the app and its state, an ``Agent``: a request's path to the model (route, admit, ask
with the retry policy of ``retry``, report each call to the ``observer.CallObserver``). The routes are
``routes``' and ``openai_api``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from ..serving.client import Completion, UpstreamError
from ..task.data import MAX_HISTORY_TURNS, MAX_QUERY_CHARS, Turn
from ..task.schema import json_schema
from ..task.traffic import TrafficRecord, TrafficWriter
from .acceptance import AcceptanceStats
from .admission import Admission, Throughput
from .cache import CoalescedCancelled, HotCache
from .canary import STATES, Canary, Decision
from .chat import ChatCall, Reading
from .config import AgentConfig
from .errors import ApiError
from .fallback import AcceptanceFallback
from .metrics import AgentMetrics
from .observer import CallObserver, canary_arm, speculative_target
from .retry import Accept, GiveUp, InvalidModelOutput, Retry, RetryPolicy, call_error
from .router import RouteDecision, Router
from .trace import AdmissionTrace, CanaryTrace, FallbackTrace, SpecTrace, Timing, TraceRecord, TraceWriter
from .upstream import Upstream, Upstreams, UpstreamUnavailable

log = logging.getLogger("cartspec.agent")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


# A number never belongs in a request body; one this long is refused before Python converts it (past 4300
# digits the conversion itself raises).
_MAX_DIGITS = 64
# What the model is never sent: C0 and C1 control characters (tab, line feed and carriage return aside) and lone
# surrogates, which JSON's \u escapes can carry but UTF-8 cannot encode.
_BAD_CHAR = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
_FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")


# --- request bodies -----------------------------------------------------------
class AskBody(BaseModel):
    """A request to /v1/search or /v1/support, within what the model's request format takes (``task.data``)."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)

    query: str = Field(max_length=MAX_QUERY_CHARS)
    history: list[Turn] = Field(default_factory=list, max_length=MAX_HISTORY_TURNS)


def request_limits(config: AgentConfig) -> tuple[int, int]:
    """(query characters, history turns) a request may have: the config's, never past the request format's
    (``AgentConfig`` refuses more at load; this holds for a config changed after it was checked)."""
    return min(config.max_query_chars, MAX_QUERY_CHARS), min(config.max_history_turns, MAX_HISTORY_TURNS)


def ask_schema(config: AgentConfig) -> dict[str, Any]:
    """``AskBody``'s JSON schema as the OpenAPI document shows it: self-contained (no references, which would
    point outside the document) and with this config's limits."""
    schema = AskBody.model_json_schema()
    schema = _inlined(schema, schema.pop("$defs", {}))
    max_chars, max_turns = request_limits(config)
    schema["properties"]["query"].update(minLength=1, maxLength=max_chars)
    schema["properties"]["history"]["maxItems"] = max_turns
    schema["properties"]["history"]["items"]["properties"]["content"]["minLength"] = 1
    return schema


def _inlined(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            return _inlined(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: _inlined(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inlined(v, defs) for v in node]
    return node


class _TooManyDigits(ValueError):
    pass


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > _MAX_DIGITS:
        raise _TooManyDigits
    return int(digits)


def _parse_json(raw: bytes) -> Any:
    """The body's JSON; ``ApiError`` 400 for anything ``json`` cannot or should not read. No reason quotes
    the body."""
    try:
        return json.loads(raw, parse_int=_bounded_int)
    except _TooManyDigits:
        raise ApiError(400, "malformed_json", f"body has a number of more than {_MAX_DIGITS} digits") from None
    except json.JSONDecodeError as exc:  # its message is a position, never the text
        raise ApiError(400, "malformed_json", f"body is not valid JSON: {exc}") from None
    except UnicodeDecodeError:
        raise ApiError(400, "malformed_json", "body is not valid UTF-8 text") from None
    except RecursionError:
        raise ApiError(400, "malformed_json", "body is nested too deeply: send a JSON object with 'query' and "
                       "an optional 'history' list of {\"role\", \"content\"} turns") from None
    except ValueError:
        raise ApiError(400, "malformed_json", "body is not valid JSON") from None


def _text_problem(text: str) -> str | None:
    """What in ``text`` the model must not be sent (a control character, a lone surrogate), without quoting it."""
    m = _BAD_CHAR.search(text)
    if m is None:
        return None
    code = f"U+{ord(m.group()):04X}"
    if "\ud800" <= m.group() <= "\udfff":
        return (f"has a lone surrogate ({code}) at character {m.start()}: send UTF-8 text, or a surrogate pair "
                "when escaping in JSON")
    return (f"has the control character {code} at character {m.start()}: of the control characters only tab, "
            "line feed and carriage return are accepted")


# --- errors -------------------------------------------------------------------
def _error(status: int, type_: str, reason: str, request_id: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    # a reason is always encodable: an unpaired surrogate in it would make the error itself fail to render
    reason = reason.encode("utf-8", "backslashreplace").decode("utf-8")
    body = {"error": {"type": type_, "reason": reason, **({"request_id": request_id} if request_id else {})}}
    return JSONResponse(body, status_code=status, headers=headers)


def _pydantic_reason(exc: ValidationError | RequestValidationError) -> str:
    """Where and what, for up to three errors; never the input (pydantic's ``input``), and a field name the
    caller made up only when it looks like one."""
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) if isinstance(p, int) or _FIELD_NAME.match(str(p)) else "<field>"
                         for p in err.get("loc", ())) or "body"
        msg = err["msg"].removeprefix("Value error, ")[:200]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


def _bare_traceback(exc: BaseException) -> str:
    """``exc``'s traceback and those it chains to, with each exception's type but not its message: a message can
    quote the request (a pydantic error's input, a codec's text), and the log must not."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    lines = []
    for e in reversed(chain):
        lines.append("Traceback (most recent call last):\n")
        lines.extend(traceback.format_tb(e.__traceback__))
        lines.append(f"{type(e).__module__}.{type(e).__qualname__} (message not logged: it may quote the request)\n")
    return "".join(lines).rstrip("\n")


# --- one answered request -----------------------------------------------------
@dataclass
class Answer:
    value: dict[str, Any]
    decision: RouteDecision | None = None
    deployment: str | None = None
    upstream: Upstream | None = None
    attempts: int = 0
    structured: list[bool] = field(default_factory=list)
    repaired: bool = False
    timing: Timing = field(default_factory=Timing)
    model_ms: float = 0.0                      # the model calls of the deployment that answered
    # the answering call (the one whose reply is the answer): what the traffic log keeps
    messages: list[dict[str, str]] = field(default_factory=list)
    reply_text: str = ""
    temperature: float = 0.0
    constrained: bool = False
    spec: SpecTrace | None = None
    stats: AcceptanceStats | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    canary_decision: Decision | None = None    # a canary decision this request made
    last_stats: AcceptanceStats | None = None  # the last model call's draft counts
    stream: "OpenStream | None" = None         # a streamed request's upstream stream, while it is relayed


@dataclass
class OpenStream:
    """A streamed request's open upstream stream: its lines, and what ``stream_ended`` needs to observe it.
    ``close()`` ends the call (the connection and the deployment's slot)."""

    stack: contextlib.AsyncExitStack
    lines: AsyncIterator[str]
    target: str
    up: Upstream
    t0: float
    queued: float
    steps_before: Any
    constrained: bool

    async def close(self) -> None:
        await self.stack.aclose()


Ask = Callable[..., Awaitable[Answer]]


def _dumped(value: Any) -> dict[str, Any]:
    """A typed commerce reply as JSON; a chat reply's value is its text, kept in ``Answer.reply_text``."""
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else {}


def make_fallback(config: AgentConfig, upstreams: Upstreams) -> AcceptanceFallback | None:
    """The acceptance fallback, on when asked or, by default, when there is a plain deployment to fall back to."""
    both = {"speculative", "plain"} <= set(upstreams.by_target)
    if config.fallback.enabled is False:
        return None
    if not both:
        if config.fallback.enabled:
            log.warning("fallback.enabled, but the agent has only the %s deployment: nothing to fall back to",
                        next(iter(upstreams.by_target)))
        return None
    return AcceptanceFallback(config.fallback)


def make_canary(config: AgentConfig, upstreams: Upstreams) -> Canary | None:
    """The canary, exactly when there is a candidate deployment beside the speculative one."""
    if "candidate" not in upstreams.by_target:
        return None
    return Canary(config.canary, candidate=upstreams["candidate"].head_ref,
                  current=upstreams["speculative"].head_ref)


class Agent:
    """What the routes share: config, deployments, cache, router, metrics, trace; and a request's path to the
    model (``answer``, ``open_stream``)."""

    def __init__(self, config: AgentConfig, upstreams: Upstreams):
        self.config = config
        self.upstreams = upstreams
        self.cache = HotCache(config.cache)
        self.fallback = make_fallback(config, upstreams)
        self.router = Router(config.router, set(upstreams.by_target) - {"candidate"}, self.fallback)
        self.canary = make_canary(config, upstreams)
        self.traffic = TrafficWriter(config.traffic) if config.traffic.dir is not None else None
        self.admission = Admission(config.admission) if config.admission.enabled else None
        self.metrics = AgentMetrics()
        self.observer = CallObserver(self.metrics, self.router, self.fallback, self.canary, upstreams)
        self.trace = TraceWriter(config.trace_path, config.trace_max_bytes)
        self.schemas = {"search": json_schema("search"), "support": json_schema("support")}
        self.started = int(time.time())
        m = self.metrics
        m.cache_entries.set_function(lambda: len(self.cache))
        for target, up in upstreams.items():
            m.inflight.labels(target).set_function(lambda up=up: up.inflight)
            m.upstream_up.labels(target).set_function(lambda up=up: 1.0 if up.health.up else 0.0)
            m.build.labels(target).info({"label": up.label, "url": up.shown_url, "model": up.model,
                                         **{k: str(v) for k, v in up.info.get("versions", {}).items()}})
            up.throughput = Throughput(config.admission.window_completions, config.admission.window_s)
            if up.step_stats:
                m.engine_steps.watch(target, up.step_stats)
            if self.admission:
                m.expected_latency.labels(target).set_function(lambda up=up: _or_nan(
                    self.admission.estimate(up.waiting, up.inflight, up.throughput).expected_s))
        if self.fallback:
            fb = self.fallback
            m.fallback_state.labels("speculative").set_function(lambda: 1.0 if fb.state == "fallback" else 0.0)
            m.rolling_acceptance.labels("speculative").set_function(lambda: _or_nan(fb.rate))
            m.rolling_observed.labels("speculative").set_function(lambda: len(fb.window))
            for direction in ("to_fallback", "to_speculative"):  # 0 from the start: rate() needs a first sample
                m.fallback_switches.labels("speculative", direction)
        if self.canary:
            cn = self.canary
            m.canary_share.set_function(lambda: cn.share)
            for state in STATES:
                m.canary_state.labels(state).set_function(lambda state=state: 1.0 if cn.state == state else 0.0)
            for arm in ("candidate", "current"):
                a = cn.arms[arm]
                m.canary_requests.labels(arm).set_function(lambda a=a: a.replies)
                m.canary_tau.labels(arm).set_function(lambda a=a: _or_nan(a.tau.mean))
                m.canary_acceptance.labels(arm).set_function(lambda a=a: _or_nan(a.total.rate))
                m.canary_errors.labels(arm)
            for decision in ("promote", "rollback"):
                m.canary_decisions.labels(decision)

    # --- input ------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        """With a key set, the request must carry it (``Authorization: Bearer KEY`` or ``X-API-Key``): /v1/* and
        /metrics; /health and /ready stay open for probes and show no credentials."""
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("x-api-key") or ""
        auth = request.headers.get("authorization") or ""
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        if not given:
            raise ApiError(401, "unauthorized", "missing API key: send 'Authorization: Bearer KEY' or 'X-API-Key'",
                           {"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "unauthorized", "wrong API key", {"WWW-Authenticate": "Bearer"})

    async def read_json(self, request: Request, what: str) -> dict[str, Any]:
        """The request's body, a JSON object (``what`` it should be, for the reasons), read within the size
        limit: ``ApiError`` (a 4xx) otherwise. No reason quotes the body: errors go to the trace and the log."""
        ctype = request.headers.get("content-type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":
            raise ApiError(415, "unsupported_media_type",
                           f"content type must be application/json, got {ctype[:80] or 'none'!r}")
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length") or ""
        # isascii: isdigit alone takes superscripts, which int() refuses; len: int() refuses past 4300 digits
        if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
            raise ApiError(413, "body_too_large", f"body is {declared[:20]} bytes; the limit is {limit}")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():  # bounded read: never buffer more than the limit
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, "body_too_large", f"body exceeds {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(400, "client_disconnected",
                           "the client closed the connection before sending its body") from None
        raw = b"".join(chunks)
        if not raw.strip():
            raise ApiError(400, "malformed_json", f"empty body: send {what}")
        data = _parse_json(raw)
        if not isinstance(data, dict):
            raise ApiError(422, "invalid_request", f"body must be a JSON object, got {type(data).__name__}")
        return data

    async def read_body(self, request: Request) -> AskBody:
        """A commerce request's body, checked: ``ApiError`` (a 4xx) for anything the model is not to be sent."""
        data = await self.read_json(request, "a JSON object with 'query'")
        if "query" not in data:
            raise ApiError(422, "invalid_request", "query: required")
        if not isinstance(data["query"], str):
            raise ApiError(422, "invalid_request", f"query: must be a string, got {type(data['query']).__name__}")
        if "history" in data and data["history"] is not None and not isinstance(data["history"], list):
            raise ApiError(422, "malformed_history",
                           "history: must be a list of {\"role\": \"user\"|\"assistant\", \"content\": str} turns")
        if data.get("history") is None:
            data.pop("history", None)
        query, history = data["query"], data.get("history", [])
        max_chars, max_turns = request_limits(self.config)  # before validation: each limit has its own type
        if not query.strip():
            raise ApiError(422, "empty_query", "query: must not be empty or blank")
        if len(query) > max_chars:
            raise ApiError(422, "query_too_long", f"query: {len(query)} characters; the limit is {max_chars}")
        if len(history) > max_turns:
            raise ApiError(422, "malformed_history", f"history: {len(history)} turns; the limit is {max_turns}")
        problem = _text_problem(query)
        if problem:
            raise ApiError(422, "invalid_characters", f"query: {problem}")
        for i, turn in enumerate(history):  # before validation, whose message for a lone surrogate is obscure
            problem = _text_problem(turn["content"]) if isinstance(turn, dict) and isinstance(
                turn.get("content"), str) else None
            if problem:
                raise ApiError(422, "malformed_history", f"history.{i}.content: {problem}")
        try:
            body = AskBody.model_validate(data)
        except ValidationError as exc:
            type_ = "malformed_history" if any(e["loc"][:1] == ("history",) for e in exc.errors()) \
                else "invalid_request"
            raise ApiError(422, type_, _pydantic_reason(exc)) from None
        for i, turn in enumerate(body.history):
            if not turn.content.strip():
                raise ApiError(422, "malformed_history", f"history.{i}.content: must not be empty")
        return body

    @property
    def model_id(self) -> str:
        """The model clients name (OpenAI's ``model``): the main deployment's served name."""
        main = self.upstreams.by_target.get("speculative") or self.upstreams["plain"]
        return main.model

    def check_model(self, name: str) -> str:
        """``name`` when it is the agent's model or a deployment's served name; the agent's model id is what
        responses name. A 404 ``model_not_found`` otherwise, naming the one to use."""
        if name == self.model_id or any(name == up.model for _, up in self.upstreams.items()):
            return self.model_id
        raise ApiError(404, "model_not_found", f"model: this agent serves '{self.model_id}' (GET /v1/models lists it)",
                       param="model")

    # --- model calls -----------------------------------------------------------
    def route(self, task: str, query: str) -> tuple[RouteDecision, Upstream]:
        main = speculative_target(self.canary)
        spec_up = self.upstreams.by_target.get(main)
        load = spec_up.inflight + spec_up.waiting if spec_up else 0
        up = self.upstreams.up()
        if main == "candidate":  # the router's speculative deployment is the candidate once promoted
            up["speculative"] = up["candidate"]
        decision = self.router.decide(task, query, load, up)
        if self.canary is not None and decision.target == "speculative" and self.canary.route():
            if self.canary.state == "trial":  # a candidate that is down still gets its share: its errors count
                decision = replace(decision, target="candidate", reason="canary")
            elif self.upstreams["candidate"].health.up:
                decision = replace(decision, target="candidate", reason="canary-promoted")
            else:
                decision = replace(decision, reason="failover-candidate-down")
        return decision, self.upstreams[decision.target]

    def admit(self, endpoint: str, target: str, up: Upstream, rec: TraceRecord) -> None:
        """Raise 503 overloaded when the request would wait past the bound (admission control on)."""
        if self.admission is None:
            return
        est = self.admission.estimate(up.waiting, up.inflight, up.throughput)
        verdict = self.admission.check(est, f"{target} ({up.label})")
        rec.admission = AdmissionTrace(admitted=verdict.admit, expected_s=est.expected_s, queued=est.queued,
                                       inflight=est.inflight, rate=est.rate)
        if not verdict.admit:
            self.metrics.admission_rejected.labels(endpoint, target).inc()
            raise ApiError(503, "overloaded", verdict.reason, {"Retry-After": str(verdict.retry_after_s)})

    # --- answering ---------------------------------------------------------------
    def _routed(self, endpoint: str, decision: RouteDecision, up: Upstream, rec: TraceRecord, ans: Answer) -> None:
        self.metrics.routes.labels(endpoint, decision.target, decision.reason).inc()
        rec.route, rec.route_reason, rec.deployment = decision.target, decision.reason, up.label
        rec.head, rec.head_version = _split_ref(up.head_ref)
        if decision.fallback is not None:
            rec.fallback = FallbackTrace(**asdict(decision.fallback))
        arm = canary_arm(self.canary, decision.target)
        if arm is not None:
            rec.canary = CanaryTrace(**asdict(self.canary.view(arm, ans.canary_decision)))
        ans.decision, ans.deployment, ans.upstream = decision, up.label, up

    async def answer(self, endpoint: str, call: ChatCall, rec: TraceRecord) -> Answer:
        """``call`` answered whole: routed, admitted, asked (with the constrained retry), observed."""
        return await self._dispatch(endpoint, call, rec, self._ask)

    async def open_stream(self, endpoint: str, call: ChatCall, rec: TraceRecord) -> Answer:
        """``call`` routed, admitted and its upstream stream opened (``Answer.stream``); what the stream
        carries is observed when it ends (``stream_ended``). A refusal before the first chunk raises here."""
        return await self._dispatch(endpoint, call, rec, self._open_stream)

    async def _dispatch(self, endpoint: str, call: ChatCall, rec: TraceRecord, run: Ask) -> Answer:
        decision, up = self.route(call.task, call.route_text)
        # Timing goes straight into the trace record, so a failed request still shows where its time went.
        ans = Answer(value={}, timing=rec.timing)
        self._routed(endpoint, decision, up, rec, ans)
        self.admit(endpoint, decision.target, up, rec)
        try:
            return await self._observed(endpoint, call, rec, ans, decision.target, up, run)
        except (UpstreamUnavailable, UpstreamError) as exc:
            if decision.target != "candidate" or not _counts_against(exc):
                raise
            # The candidate failed (counted against it): the current head answers, as it would have.
            log.warning("canary: candidate %s failed (%s); the current head answers request %s",
                        up.label, getattr(exc, "reason", None) or exc, rec.id)
            decision = replace(decision, target="speculative", reason="failover-candidate-error")
            up = self.upstreams["speculative"]
            self._routed(endpoint, decision, up, rec, ans)
            return await self._observed(endpoint, call, rec, ans, decision.target, up, run)

    async def _observed(self, endpoint: str, call: ChatCall, rec: TraceRecord, ans: Answer, target: str,
                        up: Upstream, run: Ask) -> Answer:
        """``run``, with its outcome counted for the canary's arm when the request is one of its arms' (a
        stream's once it ends)."""
        try:
            await run(endpoint, call, rec, ans, target, up)
        except (UpstreamUnavailable, UpstreamError, InvalidModelOutput) as exc:
            if _counts_against(exc):
                self.observer.on_request(target, ans, rec, error=True)
            raise
        if ans.stream is None:
            self.observer.on_request(target, ans, rec)
        return ans

    async def _call(self, endpoint: str, call: ChatCall, rec: TraceRecord, ans: Answer, target: str,
                    up: Upstream, body: dict[str, Any]) -> Completion:
        """One model call, not streamed, reported to the observer."""
        t0 = time.perf_counter()
        steps_before = self.observer.engine_steps(up)
        try:
            comp, queued = await up.complete(call.path, body)
        except (UpstreamUnavailable, UpstreamError) as exc:
            self.observer.on_error(target, exc, ans, t0)
            raise
        self.observer.on_result(endpoint, rec, ans, target, up, comp, time.perf_counter() - t0, queued, steps_before)
        return comp

    def _read(self, endpoint: str, call: ChatCall, ans: Answer, rec: TraceRecord, comp: Completion,
              temperature: float, constrained: bool) -> Reading:
        """The reply read (``call.read``), timed; a usable one is kept as the answer's."""
        t1 = time.perf_counter()
        reading = call.read(comp.text)
        self.observer.on_parse(endpoint, ans, time.perf_counter() - t1)
        if reading.value is not None or (comp.finish_reason == "length" and not call.grow_on_length):
            ans.reply_text, ans.temperature, ans.constrained = comp.text, temperature, constrained
            ans.spec, ans.stats, ans.output_tokens = rec.spec, ans.last_stats, comp.output_tokens
            ans.prompt_tokens, ans.finish_reason = comp.prompt_tokens, comp.finish_reason
        return reading

    async def _ask(self, endpoint: str, call: ChatCall, rec: TraceRecord, ans: Answer, target: str,
                   up: Upstream) -> Answer:
        """``call`` asked until its retry policy (``retry.RetryPolicy``) accepts a reply or gives up; each call
        and attempt reported to the observer."""
        ans.messages = list(call.messages or [])
        ans.structured = []
        ans.model_ms = 0.0
        policy = RetryPolicy(call)
        attempt = policy.first()
        while True:
            ans.attempts = rec.attempts = attempt.number
            ans.structured.append(attempt.constrained)
            rec.structured = ans.structured
            body = call.body(attempt.constrained, attempt.max_tokens, attempt.temperature)
            try:
                comp = await self._call(endpoint, call, rec, ans, target, up, body)
            except (UpstreamUnavailable, UpstreamError) as exc:
                raise policy.after_error(attempt, exc).error
            reading = self._read(endpoint, call, ans, rec, comp, attempt.temperature, attempt.constrained)
            step = policy.after_reply(attempt, reading, comp.finish_reason)
            answered = isinstance(step, Accept) and not step.repaired
            self.observer.on_attempt(endpoint, call, attempt.number, step.outcome, comp.output_tokens, answered)
            if isinstance(step, Retry):
                attempt = step.attempt
                continue
            if isinstance(step, GiveUp):
                raise step.error
            ans.value = _dumped(step.value)
            if step.repaired:  # every attempt needed repair: the repaired value is still typed and valid
                ans.repaired = rec.repaired = True
            return ans

    async def _open_stream(self, endpoint: str, call: ChatCall, rec: TraceRecord, ans: Answer, target: str,
                           up: Upstream) -> Answer:
        """The upstream stream of ``call``'s one attempt, open (a stream has no retry: its tokens are sent)."""
        constrained = call.plan[0]
        ans.messages = list(call.messages or [])
        ans.attempts = rec.attempts = 1
        ans.structured = rec.structured = [constrained]
        stack = contextlib.AsyncExitStack()
        t0 = time.perf_counter()
        steps_before = self.observer.engine_steps(up)
        try:
            queued, lines = await stack.enter_async_context(
                up.stream(call.path, call.body(constrained, call.max_tokens, call.temperature, stream=True)))
        except (UpstreamUnavailable, UpstreamError) as exc:
            self.observer.on_error(target, exc, ans, t0)
            raise
        ans.stream = OpenStream(stack, lines, target, up, t0, queued, steps_before, constrained)
        return ans

    def stream_ended(self, endpoint: str, call: ChatCall, rec: TraceRecord, ans: Answer, comp: Completion | None,
                     error: Exception | None = None) -> Reading | None:
        """A stream's end observed as a whole reply is: its call (``comp``: text, usage and vLLM's counts from
        the last chunks), its reading against the call's format, the router and the canary. ``error``: it
        broke off (the deployment's fault when ``_counts_against``; the client's when it left)."""
        st = ans.stream
        reading = None
        if comp is not None:
            self.observer.on_result(endpoint, rec, ans, st.target, st.up, comp, time.perf_counter() - st.t0,
                                    st.queued, st.steps_before)
            reading = self._read(endpoint, call, ans, rec, comp, call.temperature, st.constrained)
            outcome = "valid" if reading.valid else "cut" if comp.finish_reason == "length" else "invalid"
            self.observer.on_attempt(endpoint, call, 1, outcome, comp.output_tokens, answered=True)
        if comp is not None or (error is not None and _counts_against(error)):
            self.observer.on_request(st.target, ans, rec, error=comp is None)
        return reading

    # --- one request, start to end ---------------------------------------------------
    async def answer_cached(self, endpoint: str, call: ChatCall, rec: TraceRecord, key: str | None,
                            request: Request) -> Answer:
        """``answer`` within the request deadline, through the hot cache when ``key`` is set (None: not
        cacheable); ``Cache-Control: no-cache`` asks the model again. Sets the trace's cache state and status."""
        no_cache = "no-cache" in request.headers.get("cache-control", "").lower()

        async def compute() -> Answer:
            rec.cache = "off" if key is None else "bypass" if no_cache else "miss"
            return await self.answer(endpoint, call, rec)

        async def run() -> tuple[Answer, str]:
            if key is None:
                return await compute(), "off"
            return await self.cache.get_or_compute(key, compute, read=not no_cache)

        ans, rec.cache = await asyncio.wait_for(run(), timeout=self.config.request_timeout_s)
        rec.status = 200
        return ans

    def error_of(self, exc: BaseException, rid: str) -> ApiError:
        """What the caller is told of a failed request: a 4xx for what it can fix, a 5xx for what the
        deployment did; an exception the agent did not expect is logged with its traceback, never its message."""
        c = self.config
        if isinstance(exc, ApiError):
            return exc
        model_call_error = call_error(exc, c.upstream_timeout_s)  # the deployment's, or no usable reply
        if model_call_error is not None:
            return model_call_error
        if isinstance(exc, (asyncio.TimeoutError, CoalescedCancelled)):
            return ApiError(504, "timeout", f"no answer within the request deadline of {c.request_timeout_s:g}s")
        # the service keeps serving; the log says where it broke, never with what
        log.error("request %s failed:\n%s", rid, _bare_traceback(exc))
        return ApiError(500, "internal", f"internal error ({type(exc).__name__}): the agent's log has its "
                        f"traceback under request id {rid}")

    def settle(self, endpoint: str, rec: TraceRecord, t0: float, response: Response | None = None) -> None:
        """A request's end: its total time, the canary and timing headers (a response not sent yet), the
        metrics, and its trace line, whatever its outcome."""
        total = time.perf_counter() - t0
        rec.timing.total_ms = total * 1000
        if response is not None:
            if rec.canary is not None:
                response.headers["X-Cartspec-Canary"] = rec.canary.header()
            if rec.cache in FRESH and rec.status == 200:
                t = rec.timing
                response.headers["Server-Timing"] = (f"queue;dur={t.queue_ms:.1f}, upstream;dur={t.upstream_ms:.1f}, "
                                                     f"parse;dur={t.parse_ms:.2f}, total;dur={t.total_ms:.1f}")
        m = self.metrics
        if rec.cache:
            m.cache.labels(endpoint, rec.cache).inc()
        m.requests.labels(endpoint, str(rec.status)).inc()
        m.latency.labels(endpoint).observe(total)
        try:
            self.trace.write(rec)
        except OSError:
            log.exception("trace write failed")

    def records(self, rec: TraceRecord) -> bool:
        """Whether the request goes to the traffic log: answered by the model (not the cache), with a traffic
        directory set."""
        return self.traffic is not None and rec.status == 200 and rec.cache in FRESH

    # --- traffic ------------------------------------------------------------------
    _traffic_thread: ThreadPoolExecutor | None = None

    async def record_traffic_off_loop(self, rid: str, call: ChatCall, ans: Answer, rec: TraceRecord) -> None:
        """``record_traffic`` on a thread of its own: redacting a long record is CPU work that would hold the
        event loop, and one thread writes the records in the order the answers finished."""
        if self._traffic_thread is None:
            self._traffic_thread = ThreadPoolExecutor(1, thread_name_prefix="cartspec-traffic")
        await asyncio.get_running_loop().run_in_executor(self._traffic_thread, self.record_traffic,
                                                         rid, call, ans, rec)

    def record_traffic(self, rid: str, call: ChatCall, ans: Answer, rec: TraceRecord) -> None:
        """One answered request into the traffic log; a failure is logged, never the request's. A commerce
        request keeps its query and history, a chat its messages, a completion its prompt (as ``query``, with
        no messages: it went to the model without a chat template)."""
        if self.traffic is None:
            return
        try:
            up = ans.upstream
            spec = ans.spec
            head, version = _split_ref(up.head_ref if up else None)
            self.traffic.write(TrafficRecord(
                id=rid, ts=time.time(), task=call.task, query=call.prompt if call.prompt is not None else call.query,
                history=list(call.history),
                messages=ans.messages, reply=ans.reply_text, temperature=ans.temperature,
                structured=ans.constrained, route=rec.route, deployment=ans.deployment, head=head,
                head_version=version, gamma=up.gamma if up else None,
                proposed=spec.proposed if spec else 0, accepted=spec.accepted if spec else 0,
                drafts=spec.drafts if spec else 0, output_tokens=ans.output_tokens,
                latency_ms=rec.timing.total_ms))
        except Exception:
            log.exception("traffic record of request %s not written", rid)


FRESH = ("miss", "bypass", "off")  # cache states of an answer the model gave this request


def request_id(request: Request) -> str:
    """The caller's ``X-Request-Id`` when it is a plain token, else a new one."""
    rid = request.headers.get("x-request-id", "")
    return rid if _REQUEST_ID.match(rid) else uuid.uuid4().hex[:16]


def answer_headers(rec: TraceRecord, ans: Answer) -> dict[str, str]:
    """What an answer's headers say of it: the cache, and for the model's own answer the route, deployment and
    attempts."""
    headers = {"X-Cartspec-Cache": rec.cache or "off"}
    if rec.cache in FRESH:
        headers["X-Cartspec-Route"] = ans.decision.header()
        headers["X-Cartspec-Deployment"] = ans.deployment or ""
        headers["X-Cartspec-Attempts"] = str(ans.attempts)
        if ans.repaired:
            headers["X-Cartspec-Repaired"] = "1"
    return headers


def _counts_against(exc: Exception) -> bool:
    """An error the deployment made (down, unreachable, timed out, 5xx, no valid reply), not the request."""
    if isinstance(exc, UpstreamError):
        return exc.status in (0, 504) or exc.status >= 500
    return isinstance(exc, (UpstreamUnavailable, InvalidModelOutput))


def _split_ref(ref: str | None) -> tuple[str | None, str | None]:
    """``NAME@vNNNN`` -> (NAME, vNNNN); None -> (None, None)."""
    if not ref:
        return None, None
    name, _, version = ref.partition("@")
    return name, version or None


def _or_nan(x: float | None) -> float:
    return math.nan if x is None else x


def create_app(config: AgentConfig | None = None, upstream: Upstreams | Upstream | str | None = None) -> FastAPI:
    """The agent's app: its state (an ``Agent`` on ``app.state.agent``), its lifespan (the deployments' probes
    and connections, the trace and traffic files) and its routes (``routes``, ``openai_api``)."""
    from .openai_api import add_openai_routes, warm_grammar
    from .routes import add_commerce_routes, add_error_handlers, add_service_routes

    config = config or AgentConfig()
    if upstream is None:
        raise ValueError("create_app needs an upstream: an Upstreams, an Upstream or a base URL")
    agent = Agent(config, Upstreams.coerce(upstream))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # vLLM's grammar library takes seconds to import: on a thread now, not in the first schema's request
        asyncio.get_running_loop().run_in_executor(None, warm_grammar)
        for _, up in agent.upstreams.items():
            await up.start(config.upstream_timeout_s, config.max_inflight, config.max_queue,
                           config.probe_interval_s)
        try:
            yield
        finally:
            for _, up in agent.upstreams.items():
                await up.close()
            agent.trace.close()
            if agent._traffic_thread is not None:  # the records still queued are written before the file closes
                agent._traffic_thread.shutdown(wait=True)
            if agent.traffic is not None:
                agent.traffic.close()

    app = FastAPI(title="cartspec commerce agent", version="1", lifespan=lifespan)
    app.state.agent = agent

    add_error_handlers(app)
    add_commerce_routes(app, agent)
    add_openai_routes(app, agent)
    add_service_routes(app, agent)
    return app
