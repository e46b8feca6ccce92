"""A trivial OpenAI-compatible streaming server that answers at a fixed pace.

It exists to measure the load generator itself (its request ceiling and its
timing overhead) and to give the load generator's tests a server whose TTFT,
inter-token gaps and token counts are known in advance. It is not a model: it
streams ``tokens`` copies of a word, ``ttft_s`` after the request arrived and
``itl_s`` apart, then a usage chunk. Raw asyncio, no web framework, so that the
server is cheap next to the client it measures.

Knobs per server (constructor) and per request (``cartspec_fake`` in the body):
``tokens``, ``ttft_s``, ``itl_s``, ``tokens_per_chunk`` (several tokens in one
chunk, as speculative decoding does), ``fail`` (answer 500), ``abort_after``
(close the stream after that many chunks). ``/metrics`` exposes vLLM's
speculative-decoding counters, advanced by ``drafts_per_token`` per token so
that the scraper can be tested end to end.

Other servers than vLLM, per server: ``health_paths`` (the liveness paths that
answer 200; NVIDIA NIM answers ``/v1/health/ready`` and 404s ``/health``),
``metrics=False`` (no ``/metrics``, as NIM and hosted APIs), ``api_key`` (every
path answers 401 without ``Authorization: Bearer KEY``). ``answer``: a function of the request body
giving a non-streamed reply's content (a scripted judge in the quality tests).

Run alone: ``python -m cartspec.testing.trivial_server --port 8123``.
"""

from __future__ import annotations

import argparse
import asyncio
import http
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class FakeConfig:
    tokens: int = 16
    ttft_s: float = 0.0
    itl_s: float = 0.0
    tokens_per_chunk: int = 1
    gamma: int = 3
    accept_per_pos: tuple[float, ...] = (0.6, 0.3, 0.1)  # accepted / drafts at each position
    reply: str | None = None  # streamed as the content (split over the tokens) instead of "tok tok ..."
    health_paths: tuple[str, ...] = ("/health",)  # vLLM's; ("/v1/health/ready",) for NIM
    metrics: bool = True  # serve vLLM's /metrics (False: 404, as NIM)
    api_key: str | None = None  # required on every path as "Authorization: Bearer KEY" (401 without)
    answer: Callable[[dict], str] | None = None  # non-streamed replies: the content for this request body


@dataclass
class _Counters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: list[float] = field(default_factory=list)
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    seeds: list = field(default_factory=list)  # the "seed" of each chat request, None when absent
    refused: list = field(default_factory=list)  # the paths answered 401 for want of the key


class TrivialServer:
    """``with TrivialServer(FakeConfig(...)) as srv: srv.url`` serves on a loopback port in a thread."""

    def __init__(self, config: FakeConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        self.config = config or FakeConfig()
        self.host, self.port = host, port
        self.counters = _Counters(per_pos=[0.0] * self.config.gamma)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._serve_task: asyncio.Task | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --- HTTP ---------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in
                           (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0) or 0))
                route = path.split("?", 1)[0]
                key = self.config.api_key
                if key and headers.get("authorization") != f"Bearer {key}":
                    self.counters.refused.append(route)
                    self._plain(writer, 401, json.dumps({"error": {"message": "missing or invalid API key",
                                                                   "type": "unauthorized"}}), "application/json")
                elif method == "POST" and path.startswith("/v1/chat/completions"):
                    c = self.counters
                    c.in_flight += 1
                    c.max_in_flight = max(c.max_in_flight, c.in_flight)
                    try:
                        await self._chat(json.loads(body or b"{}"), writer)
                    finally:
                        c.in_flight -= 1
                elif route == "/metrics" and self.config.metrics:
                    self._plain(writer, 200, self.metrics_text(), "text/plain; version=0.0.4")
                elif route in self.config.health_paths:
                    self._plain(writer, 200, "")
                elif path.startswith("/v1/models"):
                    self._plain(writer, 200, json.dumps({"object": "list", "data": [{"id": "trivial",
                                                          "object": "model"}]}), "application/json")
                elif path.startswith("/version"):
                    self._plain(writer, 200, json.dumps({"version": "trivial"}), "application/json")
                else:
                    self._plain(writer, 404, "not found")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, asyncio.CancelledError):
            pass  # a client that hangs up, or the server stopping: neither is an error here
        finally:
            writer.close()

    @staticmethod
    def _plain(writer: asyncio.StreamWriter, status: int, text: str, ctype: str = "text/plain") -> None:
        data = text.encode()
        writer.write(f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: {ctype}\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)

    @staticmethod
    def _chunk(writer: asyncio.StreamWriter, payload: str) -> None:
        data = f"data: {payload}\n\n".encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    async def _chat(self, body: dict, writer: asyncio.StreamWriter) -> None:
        t0 = time.perf_counter()
        c = self.config
        knobs = body.get("cartspec_fake") or {}
        tokens = int(knobs.get("tokens", min(c.tokens, body.get("max_tokens") or c.tokens)))
        ttft, itl = float(knobs.get("ttft_s", c.ttft_s)), float(knobs.get("itl_s", c.itl_s))
        per_chunk = int(knobs.get("tokens_per_chunk", c.tokens_per_chunk))
        self.counters.requests += 1
        self.counters.seeds.append(body.get("seed"))
        if knobs.get("fail"):
            self._plain(writer, 500, json.dumps({"error": {"message": "injected failure"}}), "application/json")
            return
        if not body.get("stream"):
            await asyncio.sleep(ttft + itl * max(tokens - 1, 0))
            self._count(tokens)
            self._plain(writer, 200, json.dumps({
                "choices": [{"index": 0, "message": {"role": "assistant",
                                                     "content": c.answer(body) if c.answer else "tok " * tokens},
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}}),
                "application/json")
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        base = {"id": "cmpl-trivial", "object": "chat.completion.chunk", "model": body.get("model", "trivial")}
        self._chunk(writer, json.dumps({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                   "content": ""}}]}))
        await writer.drain()
        sent, n_chunks, abort_after = 0, 0, knobs.get("abort_after")
        reply = knobs.get("reply", c.reply)

        def piece(a: int, b: int) -> str:  # the content of tokens [a, b)
            if reply is None:
                return "tok " * (b - a)
            return reply[len(reply) * a // tokens: len(reply) * b // tokens]

        while sent < tokens:
            target = t0 + ttft + itl * n_chunks
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            k = min(per_chunk, tokens - sent)
            sent += k
            n_chunks += 1
            fin = "length" if sent >= tokens else None
            self._chunk(writer, json.dumps({**base, "choices": [{"index": 0, "delta": {"content": piece(sent - k, sent)},
                                                                 "finish_reason": fin}]}))
            await writer.drain()
            if abort_after is not None and n_chunks >= int(abort_after):
                writer.close()  # no terminating chunk: the client must see a broken stream
                return
        self._count(tokens)
        if (body.get("stream_options") or {}).get("include_usage"):
            self._chunk(writer, json.dumps({**base, "choices": [], "usage": {
                "prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}}))
        self._chunk(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")

    def _count(self, tokens: int) -> None:
        c, k = self.counters, self.config
        drafts = tokens / (1 + sum(k.accept_per_pos))
        c.drafts += drafts
        c.draft_tokens += drafts * k.gamma
        for i, a in enumerate(k.accept_per_pos[:k.gamma]):
            c.per_pos[i] += drafts * a
            c.accepted += drafts * a

    def metrics_text(self) -> str:
        c = self.counters
        lab = 'engine="0",model_name="trivial"'
        out = ["# TYPE vllm:spec_decode_num_drafts counter",
               f"vllm:spec_decode_num_drafts_total{{{lab}}} {c.drafts}",
               f"vllm:spec_decode_num_drafts_created{{{lab}}} 1.7e9",
               f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {c.draft_tokens}",
               f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {c.accepted}"]
        out += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {v}'
                for i, v in enumerate(c.per_pos)]
        return "\n".join(out) + "\n"

    # --- lifecycle ----------------------------------------------------------
    async def serve(self) -> None:
        self._serve_task = asyncio.current_task()
        self._server = await asyncio.start_server(self._handle, self.host, self.port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        async with self._server:
            await self._server.serve_forever()

    def start(self) -> "TrivialServer":
        def run():
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self.serve())
            except asyncio.CancelledError:
                pass
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name="trivial-server")
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("trivial server did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop and loop.is_running():
            async def shutdown():
                # The connections first, the listener last: closing it ends serve(), and with it the
                # loop; were serve() cancelled with the rest, this coroutine would never finish and
                # every stop would wait out its 5 s timeout.
                serving = self._serve_task
                tasks = [t for t in asyncio.all_tasks() if t not in (asyncio.current_task(), serving)]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                self._server.close()

            try:
                asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
            except Exception:  # already stopping: nothing left to cancel
                pass
        if self._thread:
            self._thread.join(5)

    def __enter__(self) -> "TrivialServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:  # pragma: no cover - a tool for benchmarks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--ttft", type=float, default=0.0)
    ap.add_argument("--itl", type=float, default=0.0)
    a = ap.parse_args()
    srv = TrivialServer(FakeConfig(tokens=a.tokens, ttft_s=a.ttft, itl_s=a.itl), port=a.port)
    print(f"trivial server on http://127.0.0.1:{a.port}", flush=True)
    try:
        asyncio.run(srv.serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":  # pragma: no cover
    main()
