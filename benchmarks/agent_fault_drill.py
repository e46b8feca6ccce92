"""Fault drill for the commerce agent (issue 4, "must show").

Brings up the real commerce deployment (vLLM, owned by this script) and the
agent (``cartspec serve --upstream``, its own process, as in production), then
runs a closed-loop load of 64 concurrent clients for 60 s: valid search and
support requests (some of them frequent repeats, as real traffic has) mixed
with invalid ones of every kind. Mid-run the vLLM API server process is
SIGKILLed; a few seconds later the deployment is restarted on the same port.

Checked and counted, by the phase in which each request *finished*:
  healthy    before the kill:   valid -> 2xx only, invalid -> 4xx only
  down       kill .. upstream healthy again: valid -> 503 with a reason (or a
             cache hit), invalid -> still 4xx, the agent never crashes
  recovered  after: valid -> 2xx again; recovery time measured

If the restart is slow, the load runs on past 60 s until recovery has been
seen for ``--observe-after`` seconds (the output says so).

Writes to --out: summary.json, requests.jsonl (one line per client request),
metrics.txt (agent /metrics), vllm_metrics.txt, trace.jsonl (agent trace),
trace_excerpt.jsonl, agent.log, logs/ (vLLM).

Run it alone on a shared machine:
    flock /tmp/cartspec-heavy.lock python benchmarks/agent_fault_drill.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from agent_drill_lib import AgentLoad, Mix, log, write_jsonl
from cartspec.agent.config import AgentConfig
from cartspec.agent.defaults import default_spec
from cartspec.agent.process import AgentProcess
from cartspec.results import percentile
from cartspec.serving.server import VllmServer, free_port, install_signal_handlers


def phase_of(t: float, t_kill: float, t_up: float | None) -> str:
    if t < t_kill:
        return "healthy"
    if t_up is None or t < t_up:
        return "down"
    return "recovered"


def summarise(records: list[dict], t_kill: float, t_up: float | None) -> dict:
    table: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    reasons: Counter = Counter()
    for r in records:
        ph = phase_of(r["end"], t_kill, t_up)
        s = r["status"]
        cls = "2xx" if 200 <= s < 300 else "4xx" if 400 <= s < 500 else str(s) if s in (503, 504) else \
            "5xx_other" if s >= 500 else "client_error"
        table[ph]["valid" if r["valid"] else "invalid"][cls] += 1
        if r["valid"] and s == 200 and r.get("cache") == "hit":
            table[ph]["valid"]["2xx_from_cache"] += 1
        if s == 503:
            reasons[(r.get("error"), (r.get("error_reason") or "")[:90])] += 1
    served = sorted(r["end"] for r in records if r["valid"] and r["status"] == 200
                    and r.get("cache") != "hit" and r["end"] > t_kill)
    last_503 = max((r["end"] for r in records if r["status"] == 503), default=None)
    latency: dict[str, dict] = {}
    for ph in ("healthy", "down", "recovered"):
        xs = [r["latency_s"] for r in records if r["valid"] and r["status"] == 200
              and r.get("cache") != "hit" and phase_of(r["end"], t_kill, t_up) == ph]
        if xs:
            latency[ph] = {"n": len(xs), "p50_s": round(percentile(xs, 50), 2),
                           "p95_s": round(percentile(xs, 95), 2)}
    return {
        "phases": {ph: {k: dict(v) for k, v in d.items()} for ph, d in table.items()},
        "first_model_answer_after_kill_s": round(served[0] - t_kill, 2) if served else None,
        "agent_recovery_after_upstream_healthy_s": round(served[0] - t_up, 2) if served and t_up else None,
        "last_503_at_s": last_503,
        "agent_noticed_recovery_s": round(last_503 - t_up, 2) if last_503 and t_up and last_503 > t_up else 0.0,
        "model_answer_latency": latency,
        "top_503_reasons": [{"type": t, "reason": r, "n": n} for (t, r), n in reasons.most_common(4)],
        "invalid_kinds": dict(Counter(r["kind"] for r in records if not r["valid"])),
    }


def check(summary: dict, agent_alive: bool) -> dict[str, bool]:
    p = summary["phases"]
    healthy, down, rec = p.get("healthy", {}), p.get("down", {}), p.get("recovered", {})

    def bad(d, keep):
        return sum(n for k, n in d.items() if k not in keep)

    return {
        "healthy: no 5xx for valid requests": bad(healthy.get("valid", {}), {"2xx", "2xx_from_cache", "4xx"}) == 0,
        "healthy: every valid request 2xx": bad(healthy.get("valid", {}), {"2xx", "2xx_from_cache"}) == 0,
        "every invalid request a 4xx (all phases)": all(bad(d.get("invalid", {}), {"4xx"}) == 0 for d in p.values()),
        "down: 503s with a reason": down.get("valid", {}).get("503", 0) > 0 and all(
            x["reason"] for x in summary["top_503_reasons"]),
        "recovered: valid requests 2xx again": rec.get("valid", {}).get("2xx", 0) > 0,
        "agent never crashed": agent_alive and all(
            d.get(v, {}).get("client_error", 0) == 0 for d in p.values() for v in ("valid", "invalid")),
    }


def excerpt(trace: list[dict], t0_wall: float, t_kill: float, t_up: float | None) -> list[dict]:
    """The first line of each kind (phase x outcome), in time order."""
    wanted = {}
    for t in trace:
        end = t["ts"] + t.get("timing", {}).get("total_ms", 0) / 1000  # ts is when the request arrived
        ph = phase_of(end - t0_wall, t_kill, t_up)
        if t["status"] == 200:
            kind = f"{ph}:200:{t.get('cache')}" + (":spec" if t.get("spec") else "")
        elif 400 <= t["status"] < 500:
            kind = f"{ph}:4xx"
        else:
            kind = f"{ph}:{t['status']}:{t.get('error')}"
        wanted.setdefault(kind, {"kind": kind, "end_s": round(end - t0_wall, 2), **t})
    return sorted(wanted.values(), key=lambda r: r["ts"])


def write_excerpt(out: Path, t0_wall: float, t_kill: float, t_up: float | None) -> int:
    from cartspec.agent.trace import read_trace

    trace = read_trace(out / "trace.jsonl")
    with (out / "trace_excerpt.jsonl").open("w") as fh:
        for line in excerpt(trace, t0_wall, t_kill, t_up):
            fh.write(json.dumps(line) + "\n")
    return len(trace)


async def drill(args, server: VllmServer, agent_base: str, out: Path, t0_wall_box: list) -> dict:
    load = AgentLoad(agent_base, args.clients, Mix(args.seed, args.invalid_share, args.hot_share), retry_cap_s=1.0,
                     honour_retry_after=not args.hammer, seed=args.seed)
    stop = asyncio.Event()
    timeline: dict[str, float | None] = {"kill": None, "restart_begin": None, "upstream_healthy": None}
    t0_wall_box.append(time.time())
    task = asyncio.create_task(load.run(stop, timeout_s=120))
    log(f"load: {args.clients} clients for {args.duration:.0f}s; kill at {args.kill_at:.0f}s")

    await asyncio.sleep(args.kill_at)
    victims = server.pids()
    timeline["kill"] = load.now()
    os.kill(server.proc.pid, signal.SIGKILL)  # the vLLM API server, as an OOM kill would
    log(f"killed vLLM API server pid {server.proc.pid} (group {victims}) at t={timeline['kill']:.1f}s")

    await asyncio.sleep(args.restart_after)
    timeline["restart_begin"] = load.now()
    log("restarting the deployment on the same port")
    t_r = time.monotonic()
    await asyncio.to_thread(server.restart)
    timeline["upstream_healthy"] = load.now()
    timeline["restart_s"] = time.monotonic() - t_r
    log(f"vLLM healthy again at t={timeline['upstream_healthy']:.1f}s (restart took {timeline['restart_s']:.1f}s)")

    end = max(args.duration, timeline["upstream_healthy"] + args.observe_after)
    await asyncio.sleep(max(0.0, end - load.now()))
    stop.set()
    await task
    timeline["load_end"] = load.now()
    rows = load.rows()
    write_jsonl(out / "requests.jsonl", rows)
    return {"timeline": timeline, "records": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="commerce")
    ap.add_argument("--head", default="auto")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--kill-at", type=float, default=15.0)
    ap.add_argument("--restart-after", type=float, default=4.0)
    ap.add_argument("--observe-after", type=float, default=10.0)
    ap.add_argument("--invalid-share", type=float, default=0.25)
    ap.add_argument("--hot-share", type=float, default=0.2)
    ap.add_argument("--enforce-eager", action="store_true", help="faster (re)start, slower decode")
    ap.add_argument("--hammer", action="store_true", help="clients ignore Retry-After and resend at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/agent-drill"))
    ap.add_argument("--reexcerpt", action="store_true", help="only rewrite trace_excerpt.jsonl of a finished run")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """The drill; its summary (also in OUT/summary.json), whose ``checks`` say what held."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("trace.jsonl", "trace.jsonl.1"):
        (out / stale).unlink(missing_ok=True)

    spec = default_spec(args.model, args.head, args.gamma, args.enforce_eager)
    spec = spec.model_copy(update={"max_num_seqs": 32})
    agent = None
    server = VllmServer(spec, log_dir=out / "logs", port=free_port())
    cfg = AgentConfig(trace_path=out / "trace.jsonl", upstream_timeout_s=45, request_timeout_s=90,
                      probe_interval_s=0.5)
    try:
        log(f"starting vLLM: {spec.model} {spec.label} on :{server.port}")
        t = time.monotonic()
        server.start()
        start_s = time.monotonic() - t
        info = server.info()
        log(f"vLLM healthy in {start_s:.1f}s: {info.versions.get('vllm')}, model {info.versions['model_dir']}")
        agent = AgentProcess(cfg, ["--upstream", server.url, "--label", spec.label], out, name="agent")
        log("agent: " + " ".join(agent.command()))
        base = agent.start().url
        t0_box: list[float] = []
        result = asyncio.run(drill(args, server, base, out, t0_box))
        tl = result["timeline"]
        agent_alive = agent.alive() and httpx.get(base + "/health", timeout=5).status_code == 200
        (out / "metrics.txt").write_text(httpx.get(base + "/metrics", timeout=10).text)
        try:
            (out / "vllm_metrics.txt").write_text(httpx.get(server.url + "/metrics", timeout=10).text)
        except httpx.HTTPError:
            pass
        trace_lines = write_excerpt(out, t0_box[0], tl["kill"], tl["upstream_healthy"])
        summary = summarise(result["records"], tl["kill"], tl["upstream_healthy"])
        checks = check(summary, agent_alive)
        report = {"spec": spec.model_dump(mode="json"), "versions": info.versions, "first_start_s": round(start_s, 1),
                  "clients": args.clients, "requests": len(result["records"]),
                  "requests_per_s": round(len(result["records"]) / tl["load_end"], 1),
                  "timeline_s": {k: round(v, 2) for k, v in tl.items() if v is not None},
                  "extended": tl["load_end"] > args.duration + 1, **summary, "trace_lines": trace_lines,
                  "t0_wall": t0_box[0],
                  "checks": checks, "passed": all(checks.values())}
        (out / "summary.json").write_text(json.dumps(report, indent=2))
        print(json.dumps({k: report[k] for k in ("requests", "requests_per_s", "timeline_s", "extended", "phases",
                                                 "first_model_answer_after_kill_s",
                                                 "agent_recovery_after_upstream_healthy_s",
                                                 "agent_noticed_recovery_s", "model_answer_latency", "top_503_reasons",
                                                 "checks", "passed")}, indent=2))
        return report
    finally:
        if agent is not None:
            agent.stop()
        server.stop()


def main() -> None:
    args = parse_args()
    if args.reexcerpt:
        rep = json.loads((args.out / "summary.json").read_text())
        t0 = rep.get("t0_wall") or json.loads((args.out / "trace.jsonl").open().readline())["ts"]
        tl = rep["timeline_s"]
        print(write_excerpt(args.out, t0, tl["kill"], tl.get("upstream_healthy")), "trace lines")
        return
    sys.exit(0 if run(args)["passed"] else 1)


if __name__ == "__main__":
    install_signal_handlers()  # killed (SIGTERM/SIGHUP), it still stops the vLLM servers and the agent it started
    main()
