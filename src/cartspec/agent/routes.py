"""The agent's own HTTP routes and error handlers, added to the app ``app.create_app`` builds.

``POST /v1/search``  {query, history?} -> SearchParams (every field, typed)
``POST /v1/support`` {query, history?} -> SupportReply
``GET /health`` (liveness, with upstream state), ``GET /ready`` (503 while no deployment answers),
``GET /metrics`` (Prometheus, behind the API key), ``GET /v1/info`` (what runs, behind the API key).
OpenAI's endpoints are ``openai_api``'s. A route reads and checks the request, hands it to the ``Agent`` and
renders what it answers or the error it raised (``Agent.error_of``).
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..task.data import Request as TaskRequest
from ..task.schema import SearchParams, SupportReply
from .app import Agent, ApiError, _error, _pydantic_reason, answer_headers, ask_schema, request_id
from .cache import request_key
from .chat import commerce_call
from .openai_api import OPENAI_PATHS, openai_error
from .trace import TraceRecord


def add_error_handlers(app: FastAPI) -> None:
    """The agent's error shape for what FastAPI refuses itself: an unknown path or method, a declared parameter
    that does not validate (OpenAI's shape on OpenAI's paths)."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        reason = f"{request.method[:16]} {request.url.path[:120]}: {str(exc.detail)[:200]}"
        if request.url.path in OPENAI_PATHS:  # an OpenAI client reads OpenAI's error shape
            return openai_error(ApiError(exc.status_code, type_, reason, getattr(exc, "headers", None)),
                                request_id(request))
        return _error(exc.status_code, type_, reason, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)  # a declared parameter that does not validate
    async def _invalid_parameter(request: Request, exc: RequestValidationError):
        return _error(422, "invalid_request", _pydantic_reason(exc))


def add_commerce_routes(app: FastAPI, agent: Agent) -> None:
    """``/v1/search`` and ``/v1/support``: the commerce task's call, through the hot cache."""
    config = agent.config
    body_schema = ask_schema(config)

    async def handle(request: Request, endpoint: str, task: str) -> Response:
        t0 = time.perf_counter()
        rid = request_id(request)
        rec = TraceRecord(id=rid, endpoint=endpoint)
        headers = {"X-Request-Id": rid}
        call = None
        try:
            agent.check_auth(request)
            body = await agent.read_body(request)
            req = TaskRequest(query=body.query, history=body.history, task=task)  # type: ignore[arg-type]
            call = commerce_call(task, req, agent.schemas[task], max_tokens=config.max_tokens[task],
                                 temperature=config.temperature, structured=config.structured_outputs,
                                 retry=config.retry_unparsable)
            history = [(t.role, t.content) for t in body.history]
            key = request_key(task, body.query, history) if agent.cache.cacheable(len(history)) else None
            ans = await agent.answer_cached(endpoint, call, rec, key, request)
            headers.update(answer_headers(rec, ans))
            response = JSONResponse(ans.value, headers=headers)
        except Exception as exc:
            err = agent.error_of(exc, rid)
            rec.status, rec.error, rec.reason = err.status, err.type, err.reason
            response = _error(err.status, err.type, err.reason, rid, {**headers, **err.headers})
        agent.settle(endpoint, rec, t0, response)
        if call is not None and agent.records(rec):  # after the response is sent: never delays an answer
            response.background = BackgroundTask(agent.record_traffic_off_loop, rid, call, ans, rec)
        return response

    @app.post("/v1/search", response_model=SearchParams, summary="Search parameters for a shopper's query",
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": body_schema}}}})
    async def search(request: Request):
        return await handle(request, "search", "search")

    @app.post("/v1/support", response_model=SupportReply, summary="A support reply (topic, order id, text)",
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": body_schema}}}})
    async def support(request: Request):
        return await handle(request, "support", "support")


def add_service_routes(app: FastAPI, agent: Agent) -> None:
    """``/health`` and ``/ready`` (open to probes: nothing on them is private), ``/metrics`` and ``/v1/info``
    (behind the API key, as /v1/*)."""

    @app.get("/health")
    async def health():  # open to probes: nothing on it is private (URLs redacted)
        ups = {t: {"url": u.shown_url, "deployment": u.label, **u.health.describe()}
               for t, u in agent.upstreams.items()}
        status = "ok" if all(u["up"] for u in ups.values()) else "degraded"
        return {"status": status, "upstreams": ups, "cache_entries": len(agent.cache)}

    @app.get("/ready")
    async def ready():
        down = {t: u.health.reason for t, u in agent.upstreams.items() if not u.health.up}
        if len(down) == len(agent.upstreams.by_target):
            return _error(503, "upstream_unavailable", "; ".join(f"{t}: {r}" for t, r in down.items()),
                          headers={"Retry-After": "1"})
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics(request: Request):  # what the agent serves and how much: behind the key, as /v1/*
        try:
            agent.check_auth(request)
        except ApiError as exc:
            return _error(exc.status, exc.type, exc.reason, headers=exc.headers)
        return Response(agent.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/info")
    async def info(request: Request):
        try:
            agent.check_auth(request)
        except ApiError as exc:
            return _error(exc.status, exc.type, exc.reason, headers=exc.headers)
        return {"config": agent.config.public(),
                "deployments": {t: u.public() for t, u in agent.upstreams.items()},
                "canary": agent.canary.describe() if agent.canary else None}
