"""What the agent drills share: the request mix, and a closed-loop load against the agent that keeps what
every reply said (status, cache, route, deployment, Retry-After, error).

The agent itself runs as in production, ``cartspec serve`` in its own process, owned by
``cartspec.agent.process.AgentProcess``; the load is the study's closed loop
(``cartspec.bench.loadgen.closed_loop``) with a sender that speaks the agent's API. Run a drill from the
repository root (``python benchmarks/agent_...py``): this directory is then on ``sys.path``.
"""

from __future__ import annotations

import asyncio
import json
import random
import shlex
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from cartspec.bench.loadgen import closed_loop
from cartspec.task.data import MAX_QUERY_CHARS

__all__ = ["AgentLoad", "AgentReply", "Fixed", "Mix", "log", "run_logged", "write_jsonl"]

HOT = ["red running shoes", "where is my order?", "wireless headphones under $100", "how do I return an item?",
       "black hoodie size m", "what payment methods do you take?"]

# Requests the agent must refuse with a 4xx: (how the body is sent, the body).
INVALID = {
    "empty_query": lambda: ("json", {"query": ""}),
    "blank_query": lambda: ("json", {"query": "   "}),
    "oversized_query": lambda: ("json", {"query": "shoes " * (MAX_QUERY_CHARS // 5 + 10)}),
    "missing_query": lambda: ("json", {"history": []}),
    "history_not_list": lambda: ("json", {"query": "cheaper", "history": "earlier: red shoes"}),
    "history_bad_role": lambda: ("json", {"query": "cheaper", "history": [{"role": "system", "content": "x"}]}),
    "history_too_long": lambda: ("json", {"query": "cheaper", "history": [{"role": "user", "content": "a"}] * 20}),
    "wrong_content_type": lambda: ("text", "query=red shoes"),
    "malformed_json": lambda: ("raw", '{"query": "red shoes"'),
    "query_not_string": lambda: ("json", {"query": ["red", "shoes"]}),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_logged(cmd: list[str], log_path: Path) -> float:
    """Run a command (``python -m cartspec.cli ...``), its output to ``log_path``; its wall seconds. Raises
    SystemExit with the log's tail on failure."""
    log("$ " + shlex.join(cmd[2:]))
    t0 = time.perf_counter()
    with log_path.open("w") as fh:
        fh.write("$ " + shlex.join(cmd) + "\n")
        fh.flush()
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT)
    secs = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"failed (exit {rc}) after {secs:.0f}s; see {log_path}:\n" + log_path.read_text()[-2000:])
    log(f"  done in {secs:.0f}s")
    return secs


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


@dataclass(frozen=True)
class Item:
    """One request of the mix: where it goes, how its body is sent, and what kind it is."""

    endpoint: str  # search | support
    kind: str  # search | support | hot | an INVALID kind
    valid: bool
    how: str  # json | text (text/plain) | raw (a body that is not JSON, sent as JSON)
    body: Any


class Mix:
    """Test-split search and support requests, a ``hot_share`` of frequent repeats (cache hits, as real traffic
    has) and an ``invalid_share`` of requests the agent must refuse, drawn with ``seed``."""

    def __init__(self, seed: int = 0, invalid_share: float = 0.0, hot_share: float = 0.0):
        from cartspec.task.generator import generate

        self.rng = random.Random(seed)
        self.invalid_share, self.hot_share = invalid_share, hot_share
        self.pool = generate("test", 400, seed)

    def pick(self) -> Item:
        r = self.rng.random()
        if r < self.invalid_share:
            kind = self.rng.choice(list(INVALID))
            how, body = INVALID[kind]()
            return Item(self.rng.choice(["search", "support"]), kind, False, how, body)
        if r < self.invalid_share + self.hot_share:
            q = self.rng.choice(HOT)
            task = "support" if any(w in q for w in ("order", "return", "payment")) else "search"
            return Item(task, "hot", True, "json", {"query": q})
        req = self.rng.choice(self.pool)
        body: dict[str, Any] = {"query": req.query}
        if req.history:
            body["history"] = [t.model_dump() for t in req.history]
        return Item(req.task, req.task, True, "json", body)

    def draw(self, n: int) -> list[Item]:
        """The next ``n`` requests: a closed loop cycles through them in order."""
        return [self.pick() for _ in range(n)]


@dataclass
class AgentReply:
    """What one request got from the agent. ``start``: seconds since the load began (the closed loop sets it);
    ``reason``: the route's reason (``x-cartspec-route``); ``error``/``error_reason``: the error body's."""

    id: str
    endpoint: str
    kind: str
    valid: bool
    status: int = 0
    latency_s: float = 0.0
    start: float = 0.0
    cache: str | None = None
    route_header: str | None = None
    target: str | None = None
    reason: str | None = None
    deployment: str | None = None
    retry_after: str | None = None
    error: str | None = None
    error_reason: str | None = None
    canary: str | None = None  # x-cartspec-canary: the canary's state when a canary runs

    @property
    def end(self) -> float:
        return self.start + self.latency_s

    def row(self) -> dict:
        return {**asdict(self), "start": round(self.start, 3), "end": round(self.end, 3)}


class Fixed:
    """A mix that is a fixed list of requests, each drawn once in order (``AgentLoad.run_each``)."""

    def __init__(self, requests: list[Any]):
        self.items = [Item(r.task, r.task, True, "json",
                           {"query": r.query, **({"history": [t.model_dump() for t in r.history]} if r.history
                                                 else {})}) for r in requests]

    def draw(self, n: int) -> list[Item]:
        return self.items[:n]


class AgentLoad:
    """``clients`` closed-loop clients against the agent at ``base``, each sending its next request as soon as the
    last is answered. A 503 is followed, as a well-behaved client does, by a wait of its ``Retry-After`` (1 s
    without one), capped at ``retry_cap_s`` with up to 20% jitter so refused clients do not all come back in the
    same instant; ``honour_retry_after=False`` resends at once."""

    def __init__(self, base: str, clients: int, mix: Mix, retry_cap_s: float = 5.0, honour_retry_after: bool = True,
                 seed: int = 0, n_items: int = 20_000):
        self.base, self.clients = base, clients
        self.items = mix.draw(n_items)
        self.retry_cap_s, self.honour_retry_after = retry_cap_s, honour_retry_after
        self.rng = random.Random(seed + 1)
        self.records: list[AgentReply] = []
        self.t0 = time.monotonic()

    def now(self) -> float:
        """Seconds since the load began: the clock of every record's start."""
        return time.monotonic() - self.t0

    def rows(self) -> list[dict]:
        return [r.row() for r in self.records]

    async def _send(self, http: httpx.AsyncClient, i: int, item: Item) -> AgentReply:
        rec = AgentReply(id=f"r{i:06d}", endpoint=item.endpoint, kind=item.kind, valid=item.valid)
        ctype = "text/plain" if item.how == "text" else "application/json"
        content = json.dumps(item.body) if item.how == "json" else item.body
        t = time.perf_counter()
        try:
            r = await http.post(f"{self.base}/v1/{item.endpoint}", content=content,
                                headers={"content-type": ctype, "x-request-id": rec.id})
            rec.status = r.status_code
            h = r.headers
            rec.cache, rec.route_header = h.get("x-cartspec-cache"), h.get("x-cartspec-route")
            rec.deployment, rec.retry_after = h.get("x-cartspec-deployment"), h.get("retry-after")
            rec.canary = h.get("x-cartspec-canary")
            if rec.route_header:
                target, _, rest = rec.route_header.partition(";")
                rec.target = target.strip()
                rec.reason = rest.split("reason=", 1)[-1].split(";")[0].strip() if "reason=" in rest else None
            if r.status_code >= 400:
                err = r.json().get("error", {})
                rec.error, rec.error_reason = err.get("type"), err.get("reason")
        except httpx.HTTPError as exc:  # the agent itself failed: never expected
            rec.status, rec.error, rec.error_reason = -1, "client_error", f"{type(exc).__name__}: {exc}"
        rec.latency_s = round(time.perf_counter() - t, 4)
        if rec.status == 503 and self.honour_retry_after:
            wait = min(float(rec.retry_after or 1), self.retry_cap_s)
            await asyncio.sleep(wait * (1 + 0.2 * self.rng.random()))
        return rec

    async def run_each(self, timeout_s: float = 300.0) -> None:
        """Send every item once (``clients`` at a time), then return: traffic that never repeats a request."""
        limits = httpx.Limits(max_connections=self.clients + 8, max_keepalive_connections=self.clients + 8)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
            self.t0 = time.monotonic()
            await closed_loop(lambda i, item: self._send(http, i, item), self.items, self.clients,
                              n_requests=len(self.items), on_done=self.records.append, clock=self.now)

    async def run(self, stop: asyncio.Event, timeout_s: float = 300.0) -> None:
        """Send until ``stop`` is set (a drill's phases decide when); requests in flight then finish."""
        limits = httpx.Limits(max_connections=self.clients + 8, max_keepalive_connections=self.clients + 8)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
            self.t0 = time.monotonic()
            await closed_loop(lambda i, item: self._send(http, i, item), self.items, self.clients,
                              n_requests=1 << 62, on_done=self.records.append, clock=self.now, stop=stop)
