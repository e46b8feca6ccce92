"""Acceptance fallback drill (issue 13, item 5): the agent routes away from a draft that stopped
paying, probes it, and returns when it pays again.

Two deployments of the commerce model share the machine: plain (no speculation) and speculative
with the *generic* EAGLE-3 head, which was trained for the base model and does not match the
fine-tuned target (its acceptance there: the drills' section of docs/experiments.md).
The agent (``cartspec serve --upstream SPEC --plain-upstream PLAIN``, its own process, router off
so only the fallback moves traffic, cache off so every request reaches a model) sits in front with
the acceptance fallback on. A few closed-loop clients send a steady stream:

  1. generic   rolling acceptance falls under the threshold -> fallback: plain, with probes
  2. swap      after --hold-s in fallback the speculative server is restarted on the same port
               with the *domain* head (which pays); probes fail over to plain meanwhile
  3. domain    probes accept again -> back to speculative; the load runs --after-s longer

With --spec-url/--plain-url the drill uses running servers; it cannot swap a head it does not own,
so it ends after --hold-s in fallback (phase 1 only).

Writes to --out: summary.json (requests and seconds until the fallback was detected, share routed to
plain during it, latency p50/p95 before/during/after, requests and seconds until traffic returned),
requests.jsonl (per request: time, route target and reason, fallback state, rolling acceptance,
probe, latency, status), metrics.txt (agent /metrics), trace.jsonl, agent.log (with the switch log
lines), logs/ (vLLM).

Heavy (two vLLMs, one restart): run it alone on a shared machine, under the lock:
    flock /tmp/cartspec-heavy.lock .venv/bin/python benchmarks/agent_fallback_drill.py --enforce-eager
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from agent_drill_lib import AgentLoad, Mix, log, write_jsonl
from cartspec.agent.config import AgentConfig, CacheConfig, FallbackConfig, RouterConfig
from cartspec.agent.defaults import default_spec
from cartspec.agent.process import AgentProcess
from cartspec.agent.trace import read_trace
from cartspec.agent.wiring import plain_spec
from cartspec.results import percentile
from cartspec.serving.server import VllmServer, free_port, install_signal_handlers

BACK = ("router-off",)  # with the router off, the reason of a request the fallback leaves alone


def wait_for(pred, timeout_s: float, every_s: float = 0.25):
    async def _wait() -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if pred():
                return True
            await asyncio.sleep(every_s)
        return False
    return _wait()


async def drive(args, load: AgentLoad, swap) -> dict:
    """``swap()``: restarts the speculative server with the domain head (blocking); None: cannot."""
    stop = asyncio.Event()
    task = asyncio.create_task(load.run(stop))
    tl: dict[str, float | None] = {"fallback": None, "swap_begin": None, "spec_healthy": None, "returned": None}
    log(f"load: {args.clients} clients; waiting for the fallback (at most {args.max_phase_s:.0f}s)")
    hit = await wait_for(lambda: any(r.reason == "acceptance-fallback" for r in load.records), args.max_phase_s)
    tl["fallback"] = min((r.start for r in load.records if r.reason == "acceptance-fallback"), default=None)
    log(f"fallback {'seen at t=%.1fs' % tl['fallback'] if hit else 'NOT seen'}; holding {args.hold_s:.0f}s")
    await asyncio.sleep(args.hold_s)
    if swap is not None and hit:
        tl["swap_begin"] = load.now()
        log("swap: restarting the speculative server on its port with the domain head")
        await asyncio.to_thread(swap)
        tl["spec_healthy"] = load.now()
        log(f"domain head healthy at t={tl['spec_healthy']:.1f}s; waiting for traffic to return")
        back = await wait_for(lambda: any(r.reason in BACK and r.start > tl["spec_healthy"]
                                          for r in load.records), args.max_phase_s)
        if back:
            tl["returned"] = min(r.start for r in load.records
                                 if r.reason in BACK and r.start > tl["spec_healthy"])
            log(f"traffic back on speculative at t={tl['returned']:.1f}s; {args.after_s:.0f}s more")
            await asyncio.sleep(args.after_s)
        else:
            log("traffic did NOT return")
    stop.set()
    await task
    tl["load_end"] = load.now()
    return tl


def join_trace(records: list[dict], trace: list[dict]) -> list[dict]:
    by_id = {t["id"]: t for t in trace}
    rows = []
    for r in sorted(records, key=lambda r: r["start"]):
        fb = by_id.get(r["id"], {}).get("fallback") or {}
        rows.append({"t": r["start"], "id": r["id"], "status": r["status"], "target": r.get("target"),
                     "reason": r.get("reason"), "fallback_state": fb.get("state"),
                     "rolling_acceptance": fb.get("acceptance"), "window": fb.get("observed"),
                     "probe": fb.get("probe", False), "latency_s": r["latency_s"], "endpoint": r["endpoint"],
                     **({"error": r["error"], "error_reason": r.get("error_reason")} if r.get("error") else {})})
    return rows


def summarise(rows: list[dict], tl: dict) -> dict:
    def p(xs):
        return {"n": len(xs), "p50_s": percentile(xs, 50), "p95_s": percentile(xs, 95)}

    ok = [r for r in rows if r["status"] == 200]
    first_fb = next((i for i, r in enumerate(rows) if r["fallback_state"] == "fallback"), None)
    t_fb = rows[first_fb]["t"] if first_fb is not None else None
    during = [r for r in rows if r["fallback_state"] == "fallback"]
    healthy, t_back = tl.get("spec_healthy"), tl.get("returned")
    after_healthy = [r for r in rows if healthy is not None and r["t"] >= healthy]
    until_back = next((i for i, r in enumerate(after_healthy) if r["fallback_state"] == "speculative"), None)
    return {
        "fallback_detected": {"requests": first_fb, "at_s": t_fb,
                              "speculative_replies_before": sum(1 for r in rows[:first_fb or 0]
                                                                if r["target"] == "speculative" and r["status"] == 200)},
        "during_fallback": {"requests": len(during),
                            "share_plain": round(sum(r["target"] == "plain" for r in during) / len(during), 3)
                            if during else None,
                            "probes": sum(r["probe"] for r in during),
                            "reasons": {k: sum(r["reason"] == k for r in during)
                                        for k in sorted({r["reason"] for r in during if r["reason"]})}},
        "returned": {"requests_after_spec_healthy": until_back,
                     "after_spec_healthy_s": round(t_back - healthy, 2) if t_back and healthy else None},
        "latency": {
            "before": p([r["latency_s"] for r in ok if r["fallback_state"] == "speculative"
                         and (t_fb is None or r["t"] < t_fb)]),
            "during": p([r["latency_s"] for r in ok if r["fallback_state"] == "fallback"]),
            "during_plain_only": p([r["latency_s"] for r in ok if r["fallback_state"] == "fallback"
                                    and r["target"] == "plain"]),
            "after": p([r["latency_s"] for r in ok if r["fallback_state"] == "speculative"
                        and t_back is not None and r["t"] >= t_back]),
        },
        "statuses": {str(s): sum(r["status"] == s for r in rows) for s in sorted({r["status"] for r in rows})},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="commerce")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--spec-url", help="a running speculative server (no swap then)")
    ap.add_argument("--spec-label", default="eagle3-generic-g3", help="its label, with --spec-url")
    ap.add_argument("--plain-url", help="a running plain server")
    ap.add_argument("--served-name", default="cartspec", help="model name on --spec-url/--plain-url")
    ap.add_argument("--enforce-eager", action="store_true", help="faster (re)start, slower decode")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--hold-s", type=float, default=20.0, help="seconds in fallback before the swap")
    ap.add_argument("--after-s", type=float, default=20.0, help="seconds of load after traffic returned")
    ap.add_argument("--max-phase-s", type=float, default=300.0, help="give up waiting for a switch after this")
    d = FallbackConfig()
    ap.add_argument("--threshold", type=float, default=d.threshold)
    ap.add_argument("--recover-threshold", type=float, default=d.recover_threshold)
    ap.add_argument("--window-requests", type=int, default=d.window_requests)
    ap.add_argument("--min-requests", type=int, default=d.min_requests)
    ap.add_argument("--probe-share", type=float, default=d.probe_share)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/agent-fallback-drill"))
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """The drill; its summary (also in OUT/summary.json)."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("trace.jsonl", "trace.jsonl.1"):
        (out / stale).unlink(missing_ok=True)

    generic = default_spec(args.model, "generic", args.gamma, args.enforce_eager)
    domain = default_spec(args.model, "domain", args.gamma, args.enforce_eager)
    generic, domain = (s.model_copy(update={"max_num_seqs": args.max_num_seqs}) for s in (generic, domain))
    servers: list[VllmServer] = []
    agent: AgentProcess | None = None
    try:
        plain_url = args.plain_url
        if not plain_url:
            srv = VllmServer(plain_spec(generic), log_dir=out / "logs", port=free_port())
            servers.append(srv)
            log(f"starting plain vLLM on :{srv.port}")
            plain_url = srv.start().url
        spec_server = None
        spec_url, spec_label = args.spec_url, args.spec_label
        if not spec_url:
            spec_server = VllmServer(generic, log_dir=out / "logs", port=free_port())
            servers.append(spec_server)
            log(f"starting speculative vLLM ({generic.label}) on :{spec_server.port}")
            spec_url, spec_label = spec_server.start().url, "eagle3-generic-then-domain-g3"
        cfg = AgentConfig(trace_path=out / "trace.jsonl", cache=CacheConfig(enabled=False),
                          router=RouterConfig(enabled=False), upstream_timeout_s=60, request_timeout_s=120,
                          probe_interval_s=0.5,
                          fallback=FallbackConfig(enabled=True, threshold=args.threshold,
                                                  recover_threshold=args.recover_threshold,
                                                  window_requests=args.window_requests,
                                                  min_requests=args.min_requests, probe_share=args.probe_share))
        agent = AgentProcess(cfg, ["--upstream", spec_url, "--label", spec_label, "--served-name", args.served_name,
                                   "--plain-upstream", plain_url, "--plain-served-name", args.served_name,
                                   "--no-router"], out, name="agent")
        log("agent: " + " ".join(agent.command()))
        base = agent.start().url

        def swap() -> None:
            spec_server.stop()
            on_same_port = VllmServer(domain, log_dir=out / "logs", port=spec_server.port)  # clients keep the URL
            servers.append(on_same_port)
            on_same_port.start()

        load = AgentLoad(base, args.clients, Mix(args.seed), seed=args.seed)
        tl = asyncio.run(drive(args, load, swap if spec_server else None))
        (out / "metrics.txt").write_text(httpx.get(base + "/metrics", timeout=10).text)
        rows = join_trace(load.rows(), read_trace(out / "trace.jsonl"))
        write_jsonl(out / "requests.jsonl", rows)
        switches = [ln for ln in (out / "agent.log").read_text().splitlines()
                    if "acceptance fallback:" in ln or "acceptance recovered:" in ln]
        report = {"config": cfg.fallback.model_dump(), "clients": args.clients, "requests": len(rows),
                  "deployments": {"plain": plain_url, "speculative": spec_url,
                                  "heads": [generic.label] + ([domain.label] if spec_server else [])},
                  "timeline_s": {k: round(v, 2) for k, v in tl.items() if v is not None},
                  **summarise(rows, tl), "switch_log": switches}
        report["checks"] = checks(report)
        (out / "summary.json").write_text(json.dumps(report, indent=2))
        print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))
        return report
    finally:
        if agent is not None:
            agent.stop()
        for srv in servers:
            srv.stop()


def checks(report: dict) -> dict[str, bool]:
    """What the drill shows: the fallback took traffic to plain, and (where the drill owned the speculative
    server and swapped its head) traffic came back once the draft paid again."""
    checks = {"fallback detected": report["fallback_detected"]["requests"] is not None,
              "during fallback: most requests on plain": (report["during_fallback"]["share_plain"] or 0) > 0.5,
              "no 5xx but 503, no client error": all(int(s) != -1 and (int(s) < 500 or int(s) == 503)
                                                     for s in report["statuses"])}
    if len(report["deployments"]["heads"]) > 1:
        checks["traffic returned after the swap"] = report["timeline_s"].get("returned") is not None
    return checks


def main() -> None:
    report = run(parse_args())
    sys.exit(0 if report["fallback_detected"]["requests"] is not None else 1)


if __name__ == "__main__":
    install_signal_handlers()  # killed (SIGTERM/SIGHUP), it still stops the vLLM servers and the agent it started
    main()
