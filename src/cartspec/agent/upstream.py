"""The deployments behind the agent, and what the agent knows about their health.

An ``Upstream`` is one OpenAI-compatible server (normally a ``VllmServer``).
When a call finds it unreachable it is marked down; from then on requests fail
fast with 503 and the reason, instead of each of 64 clients waiting on a dead
socket, and a background health probe (``/health``, or NIM's ``/v1/health/ready``,
or ``/v1/models``: ``ChatClient.healthy``) marks it up again as soon as the
server answers. The agent never owns the process: whoever started it restarts
it (``cartspec serve`` does), and the agent follows. What the agent shows of one
(``/health``, ``/metrics``, ``/v1/info``) is ``Upstream.public``: never its key,
its spec's environment or engine flags, or credentials in its URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

from ..serving.client import ChatClient, Completion, UpstreamError
from ..serving.urls import redact_url
from .admission import Throughput

# What of ``Upstream.info`` is public (``Upstream.public``): anything else there stays in the process.
PUBLIC_INFO = ("spec", "versions", "head")
# What of a deployment spec is private: its environment and raw engine flags may hold tokens and keys.
PRIVATE_SPEC = ("env", "engine_args")


def public_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A deployment spec's JSON without ``PRIVATE_SPEC``: what the agent keeps and shows of it."""
    return {k: v for k, v in spec.items() if k not in PRIVATE_SPEC}


class UpstreamUnavailable(RuntimeError):
    """No call was made: the deployment is known to be down, or its queue is full."""

    def __init__(self, reason: str, status: int = 503, retry_after_s: float = 1.0):
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass
class Health:
    up: bool = True  # optimistic until a call or probe says otherwise
    reason: str = ""
    since: float = field(default_factory=time.time)
    checked: float = 0.0

    def describe(self) -> dict[str, Any]:
        return {"up": self.up, "reason": self.reason or None,
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))}


class Upstream:
    def __init__(self, base_url: str, model: str = "cartspec", label: str = "", info: dict[str, Any] | None = None,
                 api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.label = label or "unknown"
        self.info = info or {}
        self.api_key = api_key
        self.health = Health()
        self.inflight = 0
        self.waiting = 0
        self.throughput = Throughput()  # completions per busy second, for admission control
        self._client: ChatClient | None = None
        self._slots: asyncio.Semaphore | None = None
        self._probe_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._timeout = 30.0
        self._max_queue = 1024
        self._probe_interval = 1.0
        self.on_health_change = None  # callback(upstream), set by the app for metrics

    @property
    def shown_url(self) -> str:
        """The URL as it may be shown, logged or traced: without ``user:pw@`` or query values."""
        return redact_url(self.base_url)

    def public(self) -> dict[str, Any]:
        """What ``/v1/info`` says of this deployment: where (``shown_url``), what runs (label, model, spec
        without env or engine flags, versions, head); never the key."""
        out = {k: self.info[k] for k in PUBLIC_INFO if k in self.info}
        if isinstance(out.get("spec"), dict):
            out["spec"] = public_spec(out["spec"])
        return {"url": self.shown_url, "label": self.label, "model": self.model, **out}

    @property
    def head_ref(self) -> str | None:
        """The head registry version it drafts with (``NAME@vNNNN``), when known (``info["head"]``)."""
        return self.info.get("head")

    @property
    def step_stats(self) -> str | None:
        """The engine's step-time file (``vllm_plugin.steps``) where the agent started the vLLM, else None."""
        return self.info.get("step_stats")

    @property
    def gamma(self) -> int | None:
        """Draft tokens per step: its spec's, else the ``-gN`` its label ends with; None when neither says."""
        spec = (self.info.get("spec") or {}).get("speculative") or {}
        if spec.get("num_speculative_tokens"):
            return int(spec["num_speculative_tokens"])
        m = re.search(r"-g(\d+)$", self.label)
        return int(m.group(1)) if m else None

    # --- lifecycle (inside the app's event loop) ----------------------------
    async def start(self, timeout_s: float, max_inflight: int, max_queue: int, probe_interval_s: float) -> None:
        self._timeout, self._max_queue, self._probe_interval = timeout_s, max_queue, probe_interval_s
        self._client = ChatClient(self.base_url, self.model, timeout=timeout_s, api_key=self.api_key,
                                  max_connections=max_inflight + 8)
        self._slots = asyncio.Semaphore(max_inflight)
        self._wake = asyncio.Event()
        await self.probe()
        self._probe_task = asyncio.create_task(self._probe_loop(), name=f"probe {self.shown_url}")

    async def close(self) -> None:
        if self._probe_task:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        if self._client:
            await self._client.aclose()

    # --- health -------------------------------------------------------------
    def _set(self, up: bool, reason: str = "") -> None:
        changed = up != self.health.up
        if changed:
            self.health = Health(up=up, reason=reason)
        elif not up and reason:
            self.health.reason = reason
        self.health.checked = time.time()
        if changed and not up and self._wake is not None:
            self._wake.set()  # start probing for recovery now, not at the next slow tick
        if changed and self.on_health_change:
            self.on_health_change(self)

    async def probe(self) -> bool:
        ok = await self._client.healthy() if self._client else False
        if ok:
            self._set(True)
        elif self.health.up:
            self._set(False, f"health check of {self.shown_url} failed")
        return ok

    async def _probe_loop(self) -> None:
        # Down: probe every interval, so recovery is seen within one. Up: now and
        # then, so /health and the up gauge are right even without traffic.
        while True:
            wait = self._probe_interval if not self.health.up else max(5.0, self._probe_interval)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)
            if self._wake.is_set():
                self._wake.clear()
                await asyncio.sleep(self._probe_interval)
            with contextlib.suppress(Exception):
                await self.probe()

    # --- calls --------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """One model call's place at this deployment, held until the block ends (a stream: its last chunk);
        yields the seconds it waited for it. Fails fast (``UpstreamUnavailable``) when the deployment is known
        to be down or its queue is full, and marks it down when the call finds it unreachable."""
        if not self.health.up:
            raise UpstreamUnavailable(f"model server {self.label} is down since "
                                      f"{self.health.describe()['since']}: {self.health.reason}",
                                      retry_after_s=self._probe_interval)
        if self.waiting >= self._max_queue:
            raise UpstreamUnavailable(f"agent overloaded: {self.waiting} requests already wait for "
                                      f"model server {self.label}", retry_after_s=1.0)
        t0 = time.perf_counter()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        queued = time.perf_counter() - t0
        self.inflight += 1
        self.throughput.begin()
        completed = False
        try:
            if not self.health.up:  # it went down while we queued
                raise UpstreamUnavailable(f"model server {self.label} went down: {self.health.reason}",
                                          retry_after_s=self._probe_interval)
            yield queued
            completed = True
        except UpstreamError as exc:
            if exc.status in (0, 502, 503):
                self._set(False, str(exc))
            raise
        finally:
            self.inflight -= 1
            self.throughput.end(completed)
            self._slots.release()

    async def chat(self, messages: list[dict[str, str]], max_tokens: int, temperature: float,
                   json_schema: dict[str, Any] | None) -> tuple[Completion, float]:
        """The completion and the seconds it waited for a free slot."""
        async with self.slot() as queued:
            comp = await self._client.chat(messages, max_tokens=max_tokens, temperature=temperature,
                                           json_schema=json_schema)
        return comp, queued

    async def complete(self, path: str, body: dict[str, Any]) -> tuple[Completion, float]:
        """``body`` (its ``model`` set to this deployment's) posted to ``path`` (``/v1/chat/completions`` or
        ``/v1/completions``), not streamed: the completion and the seconds it waited for a free slot."""
        async with self.slot() as queued:
            t0 = time.perf_counter()
            r = await self._post(path, {**body, "model": self.model})
            if r.status_code != 200:
                raise UpstreamError(f"model server answered {r.status_code}: {r.text[:300]}", r.status_code)
            comp = completion_of(r.json(), time.perf_counter() - t0)
        return comp, queued

    @contextlib.asynccontextmanager
    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[tuple[float, AsyncIterator[str]]]:
        """``body`` posted to ``path`` with ``stream`` on: (seconds queued, the response's lines as they come),
        the slot held until the block ends. A refusal (not 200) raises ``UpstreamError`` before anything is
        yielded, so the caller can still answer with an error status; leaving the block early closes the
        connection, which makes vLLM abort the request."""
        async with self.slot() as queued:
            request = self._client.http.build_request("POST", path, json={**body, "model": self.model})
            try:
                r = await self._client.http.send(request, stream=True)
            except httpx.TimeoutException as exc:
                raise UpstreamError(f"model server timed out: {type(exc).__name__}", 504) from exc
            except httpx.HTTPError as exc:
                raise UpstreamError(f"model server unreachable at {self.shown_url}: {type(exc).__name__}") from exc
            try:
                if r.status_code != 200:
                    text = (await r.aread()).decode("utf-8", "replace")
                    raise UpstreamError(f"model server answered {r.status_code}: {text[:300]}", r.status_code)
                yield queued, _lines(r)
            finally:
                await r.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return await self._client.http.post(path, json=body)
        except httpx.TimeoutException as exc:
            raise UpstreamError(f"model server timed out: {type(exc).__name__}", 504) from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(f"model server unreachable at {self.shown_url}: {type(exc).__name__}") from exc


async def _lines(r: httpx.Response) -> AsyncIterator[str]:
    try:
        async for line in r.aiter_lines():
            yield line
    except httpx.TimeoutException as exc:
        raise UpstreamError(f"model server timed out mid-stream: {type(exc).__name__}", 504) from exc
    except httpx.HTTPError as exc:
        raise UpstreamError(f"model server dropped the stream: {type(exc).__name__}") from exc


def completion_of(data: dict[str, Any], seconds: float) -> Completion:
    """A non-streamed reply of ``/v1/chat/completions`` or ``/v1/completions`` as a ``Completion``."""
    choice = (data.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
    usage = data.get("usage") or {}
    metrics = data.get("metrics") or choice.get("metrics") or {}
    return Completion(text=text or "", prompt_tokens=usage.get("prompt_tokens", 0),
                      output_tokens=usage.get("completion_tokens", 0), finish_reason=choice.get("finish_reason"),
                      seconds=seconds, request_spec_metrics=metrics.get("speculative_decoding"), raw=data)


class Upstreams:
    """The speculative deployment and, optionally, a plain one to route to and a candidate: the speculative
    deployment's target with a candidate head, which the canary (``canary.py``) tries on a share of the
    speculative deployment's traffic."""

    def __init__(self, speculative: Upstream | None = None, plain: Upstream | None = None,
                 candidate: Upstream | None = None):
        if speculative is None and plain is None:
            raise ValueError("the agent needs at least one deployment")
        if candidate is not None and speculative is None:
            raise ValueError("a canary needs a speculative main deployment: the candidate head is tried against "
                             "its head (serve it with a head: --head NAME, or a --spec with an EAGLE-3 head)")
        self.by_target: dict[str, Upstream] = {}
        if speculative is not None:
            self.by_target["speculative"] = speculative
        if plain is not None:
            self.by_target["plain"] = plain
        if candidate is not None:
            self.by_target["candidate"] = candidate

    @classmethod
    def coerce(cls, upstream: "Upstreams | Upstream | str") -> "Upstreams":
        if isinstance(upstream, Upstreams):
            return upstream
        if isinstance(upstream, str):
            upstream = Upstream(upstream)
        return cls(speculative=upstream)

    def __getitem__(self, target: str) -> Upstream:
        return self.by_target[target]

    def items(self):
        return self.by_target.items()

    def up(self) -> dict[str, bool]:
        return {t: u.health.up for t, u in self.by_target.items()}
