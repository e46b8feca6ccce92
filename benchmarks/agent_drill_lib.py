"""What the agent drills share: the agent in its own process (``cartspec serve``, as in production)
and a closed-loop load that keeps what every reply said.

The request mix is the fault drill's (``agent_fault_drill.Load.pick``: test-split search and support
requests, a share of hot repeats); only valid requests are sent here. Run a drill from the repository
root (``python benchmarks/agent_...py``): this directory is then on ``sys.path``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from agent_fault_drill import Load, log
from cartspec.agent.config import AgentConfig
from cartspec.serving.server import free_port

__all__ = ["ClosedLoop", "log", "percentile", "start_agent", "stop_agent", "write_jsonl"]


def start_agent(cfg: AgentConfig, serve_args: list[str], out: Path, name: str = "agent",
                timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """``cartspec serve --config OUT/NAME.yaml SERVE_ARGS`` on a free port; returns it and its base URL once ready."""
    cfg = cfg.model_copy(update={"port": free_port()})
    cfg.save(out / f"{name}.yaml")
    cmd = [sys.executable, "-m", "cartspec.cli", "serve", "--config", str(out / f"{name}.yaml"), *serve_args]
    log(f"{name}: " + " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=(out / f"{name}.log").open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{cfg.port}"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(base + "/ready", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: " + (out / f"{name}.log").read_text()[-2000:])
        time.sleep(0.3)
    stop_agent(proc)
    raise RuntimeError(f"{name} did not become ready")


def stop_agent(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs))) - 1))], 3)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


class ClosedLoop:
    """``clients`` concurrent clients, each sending its next request as soon as the last is answered.

    A 503 with ``Retry-After`` is honoured, as a well-behaved client does (capped at ``retry_cap_s``,
    with up to 20% jitter so refused clients do not all come back in the same instant).
    """

    def __init__(self, base: str, clients: int, seed: int = 0, hot_share: float = 0.0, retry_cap_s: float = 5.0):
        self.base, self.clients, self.retry_cap_s = base, clients, retry_cap_s
        self.mix = Load(base, clients, seed, invalid_share=0.0, hot_share=hot_share)
        self.rng = random.Random(seed + 1)
        self.records: list[dict] = []
        self.t0 = time.monotonic()
        self._n = 0

    def now(self) -> float:
        """Seconds since the load began: the clock of every record's start and end."""
        return time.monotonic() - self.t0

    async def _client(self, http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            item = self.mix.pick()
            self._n += 1
            rid = f"r{self._n:06d}"
            rec = {"id": rid, "endpoint": item["endpoint"], "kind": item["kind"],
                   "start": round(time.monotonic() - self.t0, 3)}
            t = time.perf_counter()
            try:
                r = await http.post(f"{self.base}/v1/{item['endpoint']}", content=json.dumps(item["body"]),
                                    headers={"content-type": "application/json", "x-request-id": rid})
                rec["status"] = r.status_code
                h = r.headers
                rec.update(cache=h.get("x-cartspec-cache"), route_header=h.get("x-cartspec-route"),
                           deployment=h.get("x-cartspec-deployment"), retry_after=h.get("retry-after"))
                if rec["route_header"]:
                    target, _, rest = rec["route_header"].partition(";")
                    rec["target"] = target.strip()
                    rec["reason"] = rest.split("reason=", 1)[-1].split(";")[0].strip() if "reason=" in rest else None
                if r.status_code >= 400:
                    err = r.json().get("error", {})
                    rec["error"], rec["error_reason"] = err.get("type"), err.get("reason")
            except httpx.HTTPError as exc:  # the agent itself failed: never expected
                rec.update(status=-1, error="client_error", error_reason=f"{type(exc).__name__}: {exc}")
            rec["latency_s"] = round(time.perf_counter() - t, 4)
            rec["end"] = round(time.monotonic() - self.t0, 3)
            self.records.append(rec)
            if rec["status"] == 503 and rec.get("retry_after"):
                wait = min(float(rec["retry_after"]), self.retry_cap_s)
                await asyncio.sleep(wait * (1 + 0.2 * self.rng.random()))

    async def run(self, stop: asyncio.Event, timeout_s: float = 300.0) -> None:
        """Send until ``stop`` is set; the caller sets it (a drill's phases decide when)."""
        limits = httpx.Limits(max_connections=self.clients + 8, max_keepalive_connections=self.clients + 8)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
            self.t0 = time.monotonic()
            await asyncio.gather(*(self._client(http, stop) for _ in range(self.clients)))
