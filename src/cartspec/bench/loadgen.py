"""Streaming load generator for any OpenAI-compatible chat endpoint.

Two ways to load a server: a closed loop keeps ``concurrency`` requests in
flight (each worker sends its next request when the last one ends), an open
loop sends requests at Poisson arrival times whatever the server does. A
warm-up at the same load runs first and is not measured; the speculative
counters are read from ``/metrics`` after it and after the last request.

Per request: TTFT is start → first content chunk, E2EL is start
→ last content chunk, ITL are the gaps between content chunks (one chunk can
carry several tokens under speculation), TPOT is (E2EL − TTFT) / (tokens − 1)
with the token count from the server's usage chunk. A request that fails is
recorded with its error and counted, never dropped.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Sequence, TypeVar

import httpx

from ..serving.client import auth_headers, chat_body
from .metrics import scrape, stats_from_responses
from ..results import AcceptanceStats, RequestRecord

Clock = Callable[[], float]
Req = TypeVar("Req")  # what a closed loop sends: a ChatRequest for the study
Rec = TypeVar("Rec")  # what it keeps: a RequestRecord for the study
SPEC_KEYS = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "mean_acceptance_length",
             "draft_acceptance_rate",
             # per verify step (``--per-request-spec-decode-metrics detailed``): acceptance per token class
             # in the report (analysis/classes.py) places each step on the reply's tokens
             "per_step_accepted", "per_step_drafted")


@dataclass
class ChatRequest:
    """One request body, before the load generator adds model, streaming and sampling."""

    messages: list[dict[str, str]]
    id: str = ""
    max_tokens: int = 128
    extra: dict[str, Any] = field(default_factory=dict)
    json_schema: dict[str, Any] | None = None  # constrain the reply to it (structured outputs)
    schema_name: str = "reply"
    source: Any = None  # the task request it came from (with gold, when known): lets a point score its replies
    sample: int = 0  # which reply to this request (a point may ask each request several times)


@dataclass
class LoadConfig:
    mode: str = "closed"  # "closed" | "open"
    concurrency: int = 1
    rate: float | None = None  # open loop: requests per second
    n_requests: int = 16
    duration_s: float | None = None  # stop issuing new requests after this long
    warmup: int = 0
    temperature: float = 0.0
    seed: int = 0  # < 0: no per-request seeds at T > 0 (the server's own randomness, as in production)
    timeout_s: float = 600.0
    offset: int = 0  # the first measured request is request ``offset`` of the set (a slice of a longer run)


@dataclass
class LoadResult:
    records: list[RequestRecord]
    wall_s: float
    acceptance: AcceptanceStats | None
    n_warmup: int = 0
    # the engine's steps during the measured load, by batch bucket (``vllm_plugin.steps``); None: not known
    engine_steps: dict[str, dict[str, float]] | None = None


def body_for(model: str, req: ChatRequest, temperature: float, seed: int | None) -> dict[str, Any]:
    # ``seed``: the same sampling stream for the same request on every deployment
    return chat_body(model, req.messages, max_tokens=req.max_tokens, temperature=temperature, seed=seed,
                     json_schema=req.json_schema, schema_name=req.schema_name, stream=True, extra=req.extra)


def _has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
            return True
    return False


def record_from_events(req_id: str, t_start: float, content_times: Sequence[float],
                       usage: dict[str, Any] | None, t_end: float, error: str | None = None,
                       status: int = 200, spec: dict[str, Any] | None = None,
                       text: str | None = None) -> RequestRecord:
    """The request's metrics from the arrival times of its content chunks (a pure function)."""
    ttft = content_times[0] - t_start if content_times else None
    e2el = (content_times[-1] if content_times else t_end) - t_start
    itl = [b - a for a, b in zip(content_times, content_times[1:])]
    out_tokens = int(usage.get("completion_tokens", 0)) if usage else len(content_times)
    if error is None and not content_times and out_tokens > 0:
        error = "stream ended without content"
    return RequestRecord(id=req_id, ttft=ttft, e2el=e2el if error is None else (t_end - t_start), itl=itl,
                         output_tokens=out_tokens, prompt_tokens=int(usage.get("prompt_tokens", 0)) if usage else 0,
                         chunks=len(content_times), usage_reported=usage is not None, error=error,
                         status=status, request_spec_metrics=spec, text=text)


async def stream_chat(http: httpx.AsyncClient, model: str, req: ChatRequest, temperature: float = 0.0,
                      seed: int | None = None, clock: Clock = time.perf_counter) -> RequestRecord:
    """Send one streaming chat request and time its chunks."""
    body = body_for(model, req, temperature, seed)
    content_times: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    spec: dict[str, Any] | None = None
    status, error, done = 0, None, False
    t0 = clock()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            status = r.status_code
            if status != 200:
                text = (await r.aread()).decode(errors="replace")
                error = f"HTTP {status}: {text[:300]}"
            else:
                async for line in r.aiter_lines():
                    now = clock()
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk and not chunk.get("choices"):
                        error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                        break
                    if _has_content(chunk):
                        content_times.append(now)
                        pieces.extend(c["delta"].get("content") or "" for c in chunk["choices"]
                                      if isinstance(c.get("delta"), dict))
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    sd = (chunk.get("metrics") or {}).get("speculative_decoding")
                    if sd:
                        spec = {k: sd[k] for k in SPEC_KEYS if k in sd}
                if error is None and not done:
                    error = "stream ended before [DONE]"
    except httpx.TimeoutException as exc:
        error = f"timeout: {type(exc).__name__}"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    except (json.JSONDecodeError, ValueError) as exc:
        error = f"bad stream payload: {exc}"[:300]
    rec = record_from_events(req.id, t0, content_times, usage, clock(), error, status, spec, "".join(pieces))
    rec.sample = req.sample
    return rec


OnDone = Callable[[RequestRecord], None]


async def closed_loop(send: Callable[[int, Req], Awaitable[Rec]], requests: Sequence[Req],
                      concurrency: int, n_requests: int, duration_s: float | None = None,
                      on_done: Callable[[Rec], None] | None = None, clock: Clock = time.perf_counter,
                      offset: int = 0, stop: asyncio.Event | None = None) -> tuple[list[Rec], float]:
    """Keep ``concurrency`` requests in flight until ``n_requests`` were sent (or ``duration_s`` passed, or
    ``stop`` was set: a caller whose phases decide when the load ends, as the agent drills').

    Requests are taken in order, cycling through ``requests``, from request ``offset`` on; the i-th
    measured request is the same on every deployment, so points compare paired. ``send`` returns a
    ``RequestRecord`` (or another record with a ``start`` to set: the agent drills keep the agent's headers).
    """
    records: list[Rec] = []
    next_i = 0
    t0 = clock()

    async def worker() -> None:
        nonlocal next_i
        while next_i < n_requests and (duration_s is None or clock() - t0 < duration_s) \
                and not (stop is not None and stop.is_set()):
            i = offset + next_i
            next_i += 1
            t_send = clock()
            rec = await send(i, requests[i % len(requests)])
            rec.start = t_send - t0
            records.append(rec)
            if on_done:
                on_done(rec)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return records, clock() - t0


async def open_loop(send: Callable[[int, ChatRequest], Awaitable[RequestRecord]], requests: Sequence[ChatRequest],
                    rate: float, n_requests: int, duration_s: float | None = None, seed: int = 0,
                    on_done: OnDone | None = None, clock: Clock = time.perf_counter,
                    offset: int = 0) -> tuple[list[RequestRecord], float]:
    """Poisson arrivals at ``rate`` per second, whatever the server's state (the load a real shop sees),
    requests taken in order from request ``offset`` on."""
    rng = random.Random(abs(seed) + offset)
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    t0 = clock()
    arrival = 0.0

    async def one(i: int, at: float) -> None:
        rec = await send(i, requests[i % len(requests)])
        rec.start = at
        records.append(rec)
        if on_done:
            on_done(rec)

    for i in range(n_requests):
        if duration_s is not None and arrival >= duration_s:
            break
        delay = t0 + arrival - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(offset + i, arrival)))
        arrival += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return records, clock() - t0


async def run_load(base_url: str, model: str, requests: Sequence[ChatRequest], cfg: LoadConfig,
                   on_done: OnDone | None = None, api_key: str | None = None, metrics: bool = True,
                   step_stats: Path | None = None) -> LoadResult:
    """Warm up, read the counters, run the measured load, read the counters again.

    ``metrics=False``: the endpoint has no ``/metrics`` (not vLLM, or not exposed); acceptance then
    comes from the replies' per-request metrics when they carry any, else the point has none.
    ``step_stats``: the engine's step-time file (``vllm_plugin.steps``), read before and after the same way."""
    from ..vllm_plugin import steps

    if not requests:
        raise ValueError("no requests to send")
    headers = auth_headers(api_key)
    in_flight = cfg.concurrency if cfg.mode == "closed" else 1024
    limits = httpx.Limits(max_connections=in_flight + 8, max_keepalive_connections=in_flight + 8)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, limits=limits,
                                 headers=headers) as http:

        def sender(seed_base: int) -> Callable[[int, ChatRequest], Awaitable[RequestRecord]]:
            async def send(i: int, req: ChatRequest) -> RequestRecord:
                seeded = cfg.temperature > 0 and cfg.seed >= 0
                seed = cfg.seed * 100_003 + seed_base + i if seeded else None
                return await stream_chat(http, model, req, cfg.temperature, seed)
            return send

        if cfg.warmup > 0:
            # From the end of the set, so the measured requests are not already in the prefix cache.
            warm = list(reversed(requests))
            await closed_loop(sender(1_000_000), warm, min(cfg.concurrency, cfg.warmup) if cfg.mode == "closed"
                              else min(cfg.warmup, 8), cfg.warmup)
        before = await scrape(http, base_url) if metrics else None
        if step_stats is not None:  # the engine writes its counters every EVERY_S: the warm-up's last steps too
            await asyncio.sleep(steps.EVERY_S + 0.05)
        steps_before = steps.read(step_stats)
        if cfg.mode == "closed":
            records, wall = await closed_loop(sender(0), requests, cfg.concurrency, cfg.n_requests,
                                              cfg.duration_s, on_done, offset=cfg.offset)
        else:
            if not cfg.rate:
                raise ValueError("open loop needs a rate")
            records, wall = await open_loop(sender(0), requests, cfg.rate, cfg.n_requests, cfg.duration_s,
                                            cfg.seed, on_done, offset=cfg.offset)
        after = await scrape(http, base_url) if metrics else None
        if step_stats is not None:
            await asyncio.sleep(steps.EVERY_S + 0.05)  # the engine writes its counters every EVERY_S
    engine_steps = steps.difference(steps.read(step_stats), steps_before) if step_stats is not None else None
    acceptance = (after - before).stats() if before is not None and after is not None else None
    if acceptance is None:
        acceptance = stats_from_responses([r.request_spec_metrics for r in records if r.request_spec_metrics])
    records.sort(key=lambda r: r.start)
    return LoadResult(records=records, wall_s=wall, acceptance=acceptance, n_warmup=cfg.warmup,
                      engine_steps=engine_steps or None)


def chat_requests(reqs: Iterable[Any], max_tokens: int, structured: bool = False) -> list[ChatRequest]:
    """cartspec task requests -> chat bodies (optionally constrained to the task's JSON schema)."""
    from ..task.prompts import messages

    return [ChatRequest(messages=messages(r), id=r.id or "", max_tokens=max_tokens,
                        json_schema=_schema(r.task) if structured else None, schema_name=r.task, source=r)
            for r in reqs]


def _schema(task: str) -> dict[str, Any]:
    from ..task import schema

    fn = getattr(schema, "json_schema", None)
    if fn is None:
        raise RuntimeError("cartspec.task.schema has no json_schema(task): structured requests unavailable")
    return fn(task)
