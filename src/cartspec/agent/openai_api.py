"""The agent's OpenAI-compatible API: ``/v1/chat/completions`` (streamed or not), ``/v1/completions``, ``/v1/models``.

Any client of the OpenAI API (the ``openai`` SDK, LangChain, GuideLLM, ``vllm bench serve``) talks to the agent
as it would to vLLM, and its requests take the agent's one path (``chat.ChatCall``): the API key, admission,
routing and the acceptance fallback, the canary, the constrained retry, the opt-in cache, /metrics, a trace line
with the speculative counts and traffic recording. Responses are the ``openai`` package's own types.

The model id is the main deployment's served name (``cartspec`` unless its spec names it); the served names of
the other deployments are accepted too. A ``response_format`` of type ``json_schema`` is checked before the
model sees it (JSON Schema's meta-schema, then xgrammar, vLLM's structured-output grammar, must compile it),
sent to vLLM as its structured output (where the schema drafter reads it), and the reply is validated against
it with the constrained retry of the commerce endpoints. A streamed reply is relayed chunk by chunk as vLLM
sends it; its validation can only come at the end: an invalid reply is followed by an error event
(``data: {"error": {...}}``, on which the SDK raises ``APIError``) before ``data: [DONE]``.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (plus ``request_id``); what the
caller can fix is a 4xx (400 a malformed request, 401 no or a wrong key, 404 an unknown model), ``code`` being
the agent's error type. As on the commerce endpoints, no message quotes the request's text.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import time
from typing import Any, AsyncIterator, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types import Completion as OpenAICompletion
from openai.types import CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask

from ..serving.client import Completion, UpstreamError
from .app import (_FIELD_NAME, Agent, Answer, ApiError, _inlined, _pydantic_reason, _text_problem, answer_headers,
                  request_id)
from .chat import ChatCall, read_any, read_json_object, schema_reader
from .retry import CONTEXT_TOO_LONG as _CONTEXT_TOO_LONG
from .trace import TraceRecord

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
# Fields of OpenAI's API this agent does not serve: refused with the reason, never silently ignored, since a
# client that sends them expects what they do.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logprobs", "top_logprobs", "audio",
               "modalities", "prediction", "echo", "best_of", "suffix", "logit_bias", "web_search_options")
FINISH = ("stop", "length", "tool_calls", "content_filter", "function_call")
MAX_MESSAGES = 256
# Text without the control characters and lone surrogates the agent refuses (``app._text_problem``), for the
# OpenAPI document's schemas.
ACCEPTED_TEXT = "^[^\\x00-\\x08\\x0b\\x0c\\x0e-\\x1f\\x7f-\\x9f\\ud800-\\udfff]*$"


# --- request bodies -------------------------------------------------------------------------------------------
class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, max_length=64)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field("reply", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class Sampling(BaseModel):
    """What both endpoints take. Fields beside OpenAI's own that vLLM takes (top_k, min_p, ...) are passed on;
    anything else is ignored, but for the fields listed in ``UNSUPPORTED``, which are refused."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, max_length=16)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    response_format: ResponseFormat | None = None
    user: str | None = Field(None, max_length=256)  # OpenAI's end-user id: not sent on
    # vLLM's own sampling fields
    top_k: int | None = Field(None, ge=-1, le=1_000_000)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int | None = Field(None, ge=0, le=1_000_000)
    ignore_eos: bool | None = None

    PASSED: ClassVar[tuple[str, ...]] = ("top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
              "repetition_penalty", "min_tokens", "ignore_eos")

    def sampling(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.PASSED if getattr(self, k) is not None}


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)


class CompletionBody(Sampling):
    prompt: str = Field(min_length=1)


# --- errors -------------------------------------------------------------------------------------------------
def openai_error(err: ApiError, rid: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """``err`` in OpenAI's error shape. A 422 (the commerce endpoints' status for a body that does not validate)
    is a 400 here, as OpenAI answers it."""
    status = 400 if err.status == 422 else err.status
    type_ = ("authentication_error" if status == 401 else "rate_limit_error" if status == 429
             else "server_error" if status >= 500 else "invalid_request_error")
    message = err.reason.encode("utf-8", "backslashreplace").decode("utf-8")
    body = {"error": {"message": message, "type": type_, "param": err.param, "code": err.type,
                      "request_id": rid}}
    return JSONResponse(body, status_code=status, headers={**(headers or {}), **err.headers})


def _bad(code: str, message: str, param: str | None = None) -> ApiError:
    return ApiError(400, code, message, param=param)


def _validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    for name in UNSUPPORTED:
        if data.get(name) not in (None, False, [], {}, 0):
            raise _bad("unsupported_field", f"{name}: not supported by this agent (tool calls, log probabilities "
                       "and other fields that change the reply's form are not served)", name)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        loc = [str(p) for p in exc.errors()[0].get("loc", ())]
        param = ".".join(loc) if loc and all(p.isdigit() or _FIELD_NAME.match(p) for p in loc) else None
        raise _bad("invalid_request", _pydantic_reason(exc), param) from None


# --- the JSON schema a request asks for ---------------------------------------------------------------------
def check_schema(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` cannot constrain a reply (not a JSON schema, or one vLLM's grammar cannot compile), or
    None. Blocking (xgrammar's import takes seconds the first time): run it on a thread."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/" + "/".join(str(p) for p in exc.absolute_path)
        return f"not a valid JSON schema at {where}: fails '{exc.validator}' of the meta-schema"
    return _grammar_problem(json.dumps(schema))


@functools.lru_cache(maxsize=256)
def _grammar_problem(text: str) -> str | None:
    try:
        import xgrammar as xgr
    except ImportError:  # no vLLM here: the deployment's own check answers (its 400 is relayed)
        return None
    try:
        xgr.Grammar.from_json_schema(text)
    except Exception as exc:  # xgrammar's message names the unsupported keyword or type
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        detail = detail.split("] ", 1)[-1].rsplit(": ", 1)[-1] if "] " in detail else detail
        return f"vLLM's structured-output grammar (xgrammar) cannot compile it: {detail[:200]}"
    return None


def warm_grammar() -> None:
    """Import and run the grammar compiler once (the agent's start does it on a thread)."""
    _grammar_problem('{"type": "object"}')


# --- building the call -----------------------------------------------------------------------------------------
async def _format(body: Sampling, retry: bool) -> dict[str, Any]:
    """``ChatCall`` fields for the body's ``response_format``: what is sent, how the reply is read, the plan."""
    rf = body.response_format
    if rf is None or rf.type == "text":
        return {"plan": [False], "read": read_any}
    if rf.type == "json_object":
        return {"plan": [True] + ([True] if retry else []), "read": read_json_object,
                "response_format": {"type": "json_object"}}
    if rf.json_schema is None:
        raise _bad("invalid_request", "response_format.json_schema: required with type json_schema",
                   "response_format.json_schema")
    schema = rf.json_schema.schema_
    problem = await asyncio.to_thread(check_schema, schema)
    if problem:
        raise _bad("invalid_json_schema", f"response_format.json_schema.schema: {problem}",
                   "response_format.json_schema.schema")
    sent = {"type": "json_schema", "json_schema": rf.json_schema.model_dump(by_alias=True, exclude_none=True)}
    return {"plan": [True] + ([True] if retry else []), "read": schema_reader(schema), "response_format": sent}


def _check_text(text: str, param: str) -> None:
    problem = _text_problem(text)
    if problem:
        raise _bad("invalid_characters", f"{param}: {problem}", param)


async def chat_call(agent: Agent, body: ChatBody) -> ChatCall:
    messages = []
    for i, m in enumerate(body.messages):
        text = m.text()
        _check_text(text, f"messages.{i}.content")
        messages.append({"role": m.role, "content": text})
    # what the router's length estimate reads: the last user message (the last message when none is a user's)
    last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
    return ChatCall(task="chat", max_tokens=body.max_completion_tokens or body.max_tokens,
                    temperature=body.temperature, messages=messages, sampling=body.sampling(), route_text=last_user,
                    **await _format(body, agent.config.retry_unparsable))


async def completion_call(agent: Agent, body: CompletionBody) -> ChatCall:
    _check_text(body.prompt, "prompt")
    if not body.prompt.strip():
        raise _bad("empty_prompt", "prompt: must not be empty or blank", "prompt")
    return ChatCall(task="completion", max_tokens=body.max_tokens or 16, temperature=body.temperature,
                    prompt=body.prompt, sampling=body.sampling(), route_text=body.prompt,
                    **await _format(body, agent.config.retry_unparsable))


def cache_key(call: ChatCall) -> str:
    """The exact request (a client's text is its own: no normalising), for the opt-in cache."""
    payload = [call.path, call.messages, call.prompt, call.max_tokens, call.response_format, call.sampling]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


# --- responses --------------------------------------------------------------------------------------------------
def _finish(reason: str | None) -> str:
    return reason if reason in FINISH else "stop"


def _usage(ans: Answer) -> CompletionUsage:
    return CompletionUsage(prompt_tokens=ans.prompt_tokens, completion_tokens=ans.output_tokens,
                           total_tokens=ans.prompt_tokens + ans.output_tokens)


def chat_response(ans: Answer, model: str, rid: str) -> dict[str, Any]:
    return ChatCompletion(
        id=f"chatcmpl-{rid}", object="chat.completion", created=int(time.time()), model=model, usage=_usage(ans),
        choices=[Choice(index=0, finish_reason=_finish(ans.finish_reason),
                        message=ChatCompletionMessage(role="assistant", content=ans.reply_text))],
    ).model_dump(mode="json", exclude_none=True)


def completion_response(ans: Answer, model: str, rid: str) -> dict[str, Any]:
    return OpenAICompletion(
        id=f"cmpl-{rid}", object="text_completion", created=int(time.time()), model=model, usage=_usage(ans),
        choices=[CompletionChoice(index=0, text=ans.reply_text, finish_reason=_finish(ans.finish_reason))],
    ).model_dump(mode="json", exclude_none=True)


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


class StreamedReply:
    """What a relayed stream carried, read off its chunks: the text, the finish reason, usage and vLLM's
    per-request metrics (on the usage chunk)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self.metrics: dict[str, Any] = {}
        self.done = False

    def add(self, chunk: dict[str, Any]) -> bool:
        """Take one chunk in; whether it carried text."""
        text = False
        for c in chunk.get("choices") or []:
            piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
            if piece:
                self.pieces.append(piece)
                text = True
            if c.get("finish_reason"):
                self.finish_reason = c["finish_reason"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("metrics"):
            self.metrics = chunk["metrics"]
        return text

    def completion(self, seconds: float) -> Completion:
        return Completion(text="".join(self.pieces), prompt_tokens=self.usage.get("prompt_tokens", 0),
                          output_tokens=self.usage.get("completion_tokens", 0), finish_reason=self.finish_reason,
                          seconds=seconds, request_spec_metrics=self.metrics.get("speculative_decoding"),
                          raw={"metrics": self.metrics})


async def relay(agent: Agent, endpoint: str, call: ChatCall, rec: TraceRecord, ans: Answer, t0: float,
                model: str, include_usage: bool) -> AsyncIterator[bytes]:
    """The upstream's chunks as they come (the model name made the agent's; the usage chunk only when the client
    asked for it), then what the agent adds at the end: an error event when the reply breaks its schema or the
    stream broke off, and ``[DONE]``. The request is observed, traced and recorded once it ends."""
    st = ans.stream
    reply = StreamedReply()
    failure: ApiError | None = None
    settled = False
    try:
        try:
            async for line in st.lines:
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    reply.done = True
                    break
                chunk = json.loads(payload)
                if chunk.get("error") and not chunk.get("choices"):
                    raise UpstreamError(f"model server broke off the stream: {json.dumps(chunk['error'])[:300]}", 502)
                if reply.add(chunk) and rec.timing.ttft_ms is None:
                    rec.timing.ttft_ms = (time.perf_counter() - t0) * 1000
                if not chunk.get("choices") and chunk.get("usage") and not include_usage:
                    continue
                if chunk.get("model") != model:
                    yield _event({**chunk, "model": model})
                else:
                    yield f"data: {payload}\n\n".encode()
            if not reply.done:
                raise UpstreamError("model server closed the stream before [DONE]", 502)
        except (UpstreamError, json.JSONDecodeError) as exc:
            if isinstance(exc, json.JSONDecodeError):
                exc = UpstreamError(f"model server sent a chunk that is not JSON: {exc.msg}", 502)
            agent.stream_ended(endpoint, call, rec, ans, None, exc)
            failure = agent.error_of(exc, rec.id)
        else:
            reading = agent.stream_ended(endpoint, call, rec, ans, reply.completion(time.perf_counter() - st.t0))
            if not reading.valid and reply.finish_reason != "length":
                failure = ApiError(502, "invalid_model_output", f"the streamed reply is not what response_format "
                                   f"asks: {reading.error}")
        if failure is not None:  # the status line is long sent: the trace says what the agent would have answered
            rec.status, rec.error, rec.reason = failure.status, failure.type, failure.reason
        else:
            rec.status = 200
        await st.close()
        settled = True  # before the last events: a client that has read them finds the request traced
        agent.settle(endpoint, rec, t0)
        if failure is not None:
            yield _event(json.loads(openai_error(failure, rec.id).body))
        yield b"data: [DONE]\n\n"
    except BaseException:  # the client left (cancelled) or the agent broke: the call ends here, counted as such
        if rec.status == 0:
            rec.status, rec.error, rec.reason = 499, "client_disconnected", "the client closed the stream"
        raise
    finally:
        if not settled:
            await st.close()
            agent.settle(endpoint, rec, t0)


async def record_streamed(agent: Agent, call: ChatCall, ans: Answer, rec: TraceRecord) -> None:
    """A stream's traffic record, after its last byte was sent (a response's background task)."""
    if agent.records(rec):
        await agent.record_traffic_off_loop(rec.id, call, ans, rec)


# --- routes -----------------------------------------------------------------------------------------------------
def add_openai_routes(app: FastAPI, agent: Agent) -> None:
    """``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` on ``app``."""

    async def handle(request: Request, endpoint: str, body_type: type[Sampling]) -> Response:
        t0 = time.perf_counter()
        rid = request_id(request)
        rec = TraceRecord(id=rid, endpoint=endpoint)
        headers = {"X-Request-Id": rid}
        call = ans = None
        try:
            agent.check_auth(request)
            data = await agent.read_json(request, "a JSON object of OpenAI's API")
            body = _validated(body_type, data)
            model = agent.check_model(body.model)
            call = await (chat_call(agent, body) if body_type is ChatBody else completion_call(agent, body))
            if body.stream:
                rec.cache = "off"
                ans = await asyncio.wait_for(agent.open_stream(endpoint, call, rec), agent.config.request_timeout_s)
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(relay(agent, endpoint, call, rec, ans, t0, model, include_usage),
                                         media_type="text/event-stream",
                                         headers={**headers, **answer_headers(rec, ans), "Cache-Control": "no-cache",
                                                  "X-Accel-Buffering": "no"},
                                         background=BackgroundTask(record_streamed, agent, call, ans, rec))
            cacheable = agent.config.cache.enabled and agent.config.cache.openai and call.temperature == 0
            ans = await agent.answer_cached(endpoint, call, rec, cache_key(call) if cacheable else None, request)
            headers.update(answer_headers(rec, ans))
            make = chat_response if body_type is ChatBody else completion_response
            response: Response = JSONResponse(make(ans, model, rid), headers=headers)
        except Exception as exc:
            if ans is not None and ans.stream is not None:  # opened, then failed before the response: close it
                await ans.stream.close()
            err = openai_upstream_error(exc) or agent.error_of(exc, rid)
            rec.status, rec.error, rec.reason = (400 if err.status == 422 else err.status), err.type, err.reason
            response = openai_error(err, rid, headers)
        agent.settle(endpoint, rec, t0, response)
        if call is not None and agent.records(rec):
            response.background = BackgroundTask(agent.record_traffic_off_loop, rid, call, ans, rec)
        return response

    chat_schema, completion_schema = (_inlined(s, s.pop("$defs", {})) for s in (
        ChatBody.model_json_schema(by_alias=True), CompletionBody.model_json_schema(by_alias=True)))
    for schema in (chat_schema, completion_schema):  # the fuzzer's valid requests name the served model
        schema["properties"]["model"]["enum"] = [agent.model_id]
    # and send text the model may be sent (``_text_problem``)
    completion_schema["properties"]["prompt"]["pattern"] = ACCEPTED_TEXT
    for alt in chat_schema["properties"]["messages"]["items"]["properties"]["content"]["anyOf"]:
        (alt if alt.get("type") == "string" else alt["items"]["properties"]["text"])["pattern"] = ACCEPTED_TEXT

    def body_doc(schema: dict[str, Any]) -> dict[str, Any]:
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}

    @app.post("/v1/chat/completions", summary="OpenAI's chat completions (stream: server-sent events)",
              openapi_extra=body_doc(chat_schema))
    async def chat_completions(request: Request):
        return await handle(request, "chat", ChatBody)

    @app.post("/v1/completions", summary="OpenAI's (legacy) text completions", openapi_extra=body_doc(completion_schema))
    async def completions(request: Request):
        return await handle(request, "completion", CompletionBody)

    @app.get("/v1/models", summary="The model this agent serves")
    async def models(request: Request):
        try:
            agent.check_auth(request)
        except ApiError as exc:
            return openai_error(exc, request_id(request))
        model = Model(id=agent.model_id, object="model", created=agent.started, owned_by="cartspec")
        return {"object": "list", "data": [model.model_dump(mode="json")]}


def openai_upstream_error(exc: BaseException) -> ApiError | None:
    """A deployment's refusal of a request (vLLM's 4xx: a schema its grammar cannot compile, a prompt past the
    context) is the client's to fix: a 400 with vLLM's reason, where the commerce endpoints answer 502."""
    if not isinstance(exc, UpstreamError) or not 400 <= exc.status < 500:
        return None
    if _CONTEXT_TOO_LONG.search(str(exc)):
        return _bad("context_length_exceeded", "the messages do not fit the model's context: shorten them or lower "
                    "max_tokens", "messages")
    return _bad("upstream_rejected", f"the model server refused the request: {exc}")

