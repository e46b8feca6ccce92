"""A small async client for any OpenAI-compatible chat endpoint (vLLM, SGLang, ...)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import httpx

from .urls import redact_url


# Liveness paths, in the order they are tried: vLLM and SGLang answer ``/health``; NVIDIA NIM answers
# ``/v1/health/ready`` (its ``/health`` is 404); any OpenAI-compatible server answers ``/v1/models``.
HEALTH_PATHS = ("/health", "/v1/health/ready", "/v1/models")


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header every call to a keyed endpoint carries (health, models, metrics and chat alike)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def chat_body(model: str, messages: list[dict[str, str]], *, max_tokens: int, temperature: float,
              seed: int | None = None, json_schema: dict[str, Any] | None = None, schema_name: str = "reply",
              stream: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body of one ``/v1/chat/completions`` request; every caller builds it here.

    ``json_schema`` constrains the reply (OpenAI's ``response_format``, vLLM structured outputs);
    ``schema_name`` only labels it. ``stream`` asks for chunks and a final usage chunk (the load
    generator times them). ``extra`` is merged last, so a caller can add any engine-specific field.
    """
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": temperature}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if seed is not None:
        body["seed"] = seed
    if json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": schema_name, "schema": json_schema}}
    if extra:
        body.update(extra)
    return body


class UpstreamError(RuntimeError):
    """The model server refused or failed a request; ``status`` is its HTTP code (0: unreachable)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


@dataclass
class Completion:
    text: str
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    seconds: float = 0.0
    request_spec_metrics: dict[str, Any] | None = None  # vLLM per-request speculative metrics, when enabled
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


class ChatClient:
    def __init__(self, base_url: str, model: str, timeout: float = 120.0, api_key: str | None = None,
                 max_connections: int = 256):
        self.base_url = base_url.rstrip("/")
        self.model = model
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, headers=auth_headers(api_key),
                                       limits=limits)
        self._health_path = HEALTH_PATHS[0]

    @property
    def http(self) -> httpx.AsyncClient:
        """The connection pool, with the key and base URL set: for calls ``chat`` does not make (a stream)."""
        return self._http

    async def chat(self, messages: list[dict[str, str]], max_tokens: int = 256, temperature: float = 0.0,
                   json_schema: dict[str, Any] | None = None, seed: int | None = None,
                   extra: dict[str, Any] | None = None) -> Completion:
        body = chat_body(self.model, messages, max_tokens=max_tokens, temperature=temperature, seed=seed,
                         json_schema=json_schema, extra=extra)
        t0 = time.perf_counter()
        try:
            r = await self._http.post("/v1/chat/completions", json=body)
        except httpx.TimeoutException as exc:
            raise UpstreamError(f"model server timed out: {type(exc).__name__}", 504) from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(f"model server unreachable at {redact_url(self.base_url)}: "
                                f"{type(exc).__name__}") from exc
        if r.status_code != 200:
            raise UpstreamError(f"model server answered {r.status_code}: {r.text[:300]}", r.status_code)
        data = r.json()
        choice = data["choices"][0]
        usage = data.get("usage") or {}
        metrics = data.get("metrics") or choice.get("metrics") or {}
        return Completion(text=choice["message"].get("content") or "",
                          prompt_tokens=usage.get("prompt_tokens", 0),
                          output_tokens=usage.get("completion_tokens", 0),
                          finish_reason=choice.get("finish_reason"),
                          seconds=time.perf_counter() - t0,
                          request_spec_metrics=metrics.get("speculative_decoding"), raw=data)

    async def metrics_text(self) -> str:
        r = await self._http.get("/metrics")
        r.raise_for_status()
        return r.text

    async def healthy(self) -> bool:
        """Whether the server answers one of ``HEALTH_PATHS``; the path that answered is tried first next time."""
        for path in (self._health_path, *(p for p in HEALTH_PATHS if p != self._health_path)):
            try:
                if (await self._http.get(path, timeout=2.0)).status_code == 200:
                    self._health_path = path
                    return True
            except httpx.HTTPError:
                return False  # unreachable or too slow: no other path will do better, and probes must be quick
        return False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "ChatClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


async def gather_limited(coros: Iterable, limit: int, on_done=None) -> list:
    """Run coroutines with at most ``limit`` in flight; results in input order."""
    sem = asyncio.Semaphore(limit)
    coros = list(coros)

    async def run(i, c):
        async with sem:
            try:
                res = await c
            except Exception as exc:  # recorded per item, never dropped
                res = exc
            if on_done:
                on_done(i, res)
            return res

    return await asyncio.gather(*(run(i, c) for i, c in enumerate(coros)))


def parse_sse_line(line: str) -> dict[str, Any] | None:
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return None
    return json.loads(payload)
