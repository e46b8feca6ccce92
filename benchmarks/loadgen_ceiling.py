"""How much load cartspec's load generator can drive, and how much time it adds per request.

A trivial streaming server (``cartspec.testing.trivial_server``) runs in its own
process so the load generator's event loop is measured alone:

1. ceiling: the server answers instantly (16 tokens, no pacing); requests/s and
   chunks/s the load generator sustains at several concurrencies, and its own CPU
   time per request;
2. overhead: the server paces its reply (TTFT 50 ms, then 15 gaps of 10 ms);
   the load generator's TTFT and E2EL minus the server's schedule is the time it
   adds per request (client and loopback, upper bound: it includes the server's
   own scheduling delay).

    flock /tmp/cartspec-heavy.lock python benchmarks/loadgen_ceiling.py [--out runs/benchmarks]

Run it on an otherwise idle machine: the number is the client's, not the box's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cartspec.bench.loadgen import ChatRequest, LoadConfig, run_load
from cartspec.results import percentile
from cartspec.serving.server import free_port

MSG = [{"role": "user", "content": "red trail runners under $120, size 10, no nike"}]


def start_server(tokens: int, ttft: float, itl: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cartspec.testing.trivial_server", "--port", str(port), "--tokens",
                             str(tokens), "--ttft", str(ttft), "--itl", str(itl)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("trivial server did not start")


def measure(url: str, concurrency: int, n: int) -> dict:
    reqs = [ChatRequest(messages=MSG, id=str(i), max_tokens=64) for i in range(64)]
    cpu0 = time.process_time()
    res = asyncio.run(run_load(url, "trivial", reqs, LoadConfig(concurrency=concurrency, n_requests=n,
                                                                warmup=min(concurrency, 8))))
    cpu = time.process_time() - cpu0
    ok = [r for r in res.records if r.ok]
    return {"concurrency": concurrency, "requests": n, "errors": n - len(ok), "wall_s": res.wall_s,
            "requests_per_s": len(ok) / res.wall_s, "chunks_per_s": sum(r.chunks for r in ok) / res.wall_s,
            "client_cpu_ms_per_request": 1000 * cpu / (n + min(concurrency, 8)),
            "ttft_p50_ms": 1000 * statistics.median(r.ttft for r in ok),
            "e2el_p50_ms": 1000 * statistics.median(r.e2el for r in ok),
            "e2el_p99_ms": 1000 * percentile((r.e2el for r in ok), 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/benchmarks"))
    ap.add_argument("--requests", type=int, default=2000)
    a = ap.parse_args()
    out = {"machine": f"{os.cpu_count()} cores", "ceiling": [], "overhead": []}

    proc, url = start_server(tokens=16, ttft=0.0, itl=0.0)
    try:
        for c in (1, 8, 32, 64):
            row = measure(url, c, a.requests if c > 1 else a.requests // 4)
            out["ceiling"].append(row)
            print(f"ceiling  c={c:3d}: {row['requests_per_s']:7.0f} req/s  {row['chunks_per_s']:8.0f} chunks/s  "
                  f"client CPU {row['client_cpu_ms_per_request']:.2f} ms/request  errors {row['errors']}")
    finally:
        proc.kill()

    ttft, itl, tokens = 0.05, 0.01, 16
    expect_ttft, expect_e2el = ttft, ttft + (tokens - 1) * itl
    proc, url = start_server(tokens=tokens, ttft=ttft, itl=itl)
    try:
        for c in (1, 8, 32):
            row = measure(url, c, 40 if c == 1 else 8 * c)
            row["ttft_overhead_ms"] = row["ttft_p50_ms"] - 1000 * expect_ttft
            row["e2el_overhead_ms"] = row["e2el_p50_ms"] - 1000 * expect_e2el
            out["overhead"].append(row)
            print(f"overhead c={c:3d}: TTFT p50 {row['ttft_p50_ms']:.2f} ms (+{row['ttft_overhead_ms']:.2f}), "
                  f"E2EL p50 {row['e2el_p50_ms']:.2f} ms (+{row['e2el_overhead_ms']:.2f} over the server's "
                  f"{1000 * expect_e2el:.0f} ms schedule)")
    finally:
        proc.kill()
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "loadgen_ceiling.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
