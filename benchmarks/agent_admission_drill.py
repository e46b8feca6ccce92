"""Admission control drill (issue 13, item 6): under overload, refuse early instead of answering late.

One deployment of the commerce model (started here, or --url), the agent in front
(``cartspec serve --upstream URL --admission-max-wait S``, its own process, cache on as in
production), and --clients closed-loop clients (64) for --duration seconds (60). Refused clients
honour Retry-After. Without admission the fresh answers' p50 of this load is far over the --slo
(docs/serving.md, "Two deployments, acceptance fallback, admission control", and the drills' section of
docs/experiments.md); with it, the admitted requests should meet the SLO and the rest get a fast 503.

Printed and written to --out/summary.json, per mode (``--compare`` runs admission off first, on a
second agent, against the same deployment): p50/p95/p99 latency of admitted fresh answers (cache
misses, 200) and of all 200s vs --slo, the same after the first --warmup-s (the first wave is
admitted before any completion is measured), the share within the SLO, answered requests per second,
503s with Retry-After (``overloaded``), other 503s, other 5xx (must be 0), client errors (must be 0).
Also requests-<mode>.jsonl, metrics-<mode>.txt, agent-<mode>.log, logs/ (vLLM).

Heavy (vLLM at full load for a minute): run it alone on a shared machine, under the lock:
    flock /tmp/cartspec-heavy.lock .venv/bin/python benchmarks/agent_admission_drill.py --enforce-eager
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx

from agent_drill_lib import AgentLoad, Mix, log, write_jsonl
from cartspec.agent.config import AdmissionConfig, AgentConfig
from cartspec.agent.defaults import default_spec
from cartspec.agent.process import AgentProcess
from cartspec.results import percentile
from cartspec.serving.server import VllmServer, free_port, install_signal_handlers


async def load_for(load: AgentLoad, seconds: float) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(load.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    await task  # requests in flight finish: their latency counts


def summarise(records: list[dict], slo_s: float, warmup_s: float, duration_s: float) -> dict:
    def lat(rs):
        xs = [r["latency_s"] for r in rs]
        return {"n": len(xs), "p50_s": percentile(xs, 50), "p95_s": percentile(xs, 95),
                "p99_s": percentile(xs, 99),
                "within_slo": round(sum(x <= slo_s for x in xs) / len(xs), 3) if xs else None}

    ok = [r for r in records if r["status"] == 200]
    fresh = [r for r in ok if r.get("cache") != "hit"]
    steady = [r for r in fresh if r["start"] >= warmup_s]
    overloaded = [r for r in records if r["status"] == 503 and r.get("error") == "overloaded"]
    return {
        "requests": len(records),
        "answered_per_s": round(len(ok) / duration_s, 2),
        "fresh_answers": lat(fresh),
        "fresh_answers_after_warmup": lat(steady),
        "all_200": lat(ok),
        "overloaded_503": len(overloaded),
        "overloaded_503_with_retry_after": sum(1 for r in overloaded if r.get("retry_after")),
        "overloaded_503_latency": lat(overloaded),
        "retry_after_s": sorted({int(r["retry_after"]) for r in overloaded if r.get("retry_after")}),
        "other_503": sum(1 for r in records if r["status"] == 503 and r.get("error") != "overloaded"),
        "other_5xx": sum(1 for r in records if r["status"] >= 500 and r["status"] != 503),
        "client_errors": sum(1 for r in records if r["status"] == -1),
        "other_503_reasons": sorted({(r.get("error_reason") or "")[:120] for r in records
                                     if r["status"] == 503 and r.get("error") != "overloaded"})[:5],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running OpenAI-compatible server (start none)")
    ap.add_argument("--label", default="external", help="what runs on --url")
    ap.add_argument("--served-name", default="cartspec")
    ap.add_argument("--model", default="commerce")
    ap.add_argument("--head", default="auto")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true", help="faster start, slower decode")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-wait", type=float, default=AdmissionConfig().max_wait_s, help="admission bound, s")
    ap.add_argument("--slo", type=float, default=2.0, help="latency SLO the report compares with, s")
    ap.add_argument("--warmup-s", type=float, default=15.0)
    ap.add_argument("--hot-share", type=float, default=0.2, help="share of frequent repeats (cache hits)")
    ap.add_argument("--retry-cap", type=float, default=5.0, help="longest Retry-After a client honours, s")
    ap.add_argument("--compare", action="store_true", help="first the same load with admission off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/agent-admission-drill"))
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """The drill; its summary (also in OUT/summary.json), whose ``checks`` say what held."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    server = None
    report: dict = {"clients": args.clients, "duration_s": args.duration, "slo_s": args.slo,
                    "max_wait_s": args.max_wait, "modes": {}}
    try:
        url, label, name = args.url, args.label, args.served_name
        if not url:
            spec = default_spec(args.model, args.head, args.gamma, args.enforce_eager)
            server = VllmServer(spec, log_dir=out / "logs", port=free_port())
            log(f"starting vLLM: {spec.model} {spec.label} on :{server.port}")
            url, label, name = server.start().url, spec.label, spec.name
            report["deployment"] = {"spec": spec.model_dump(mode="json"), "versions": server.info().versions}
        for mode in (["off"] if args.compare else []) + ["admission"]:
            for stale in (f"trace-{mode}.jsonl", f"trace-{mode}.jsonl.1"):
                (out / stale).unlink(missing_ok=True)
            cfg = AgentConfig(trace_path=out / f"trace-{mode}.jsonl", upstream_timeout_s=60, request_timeout_s=120,
                              admission=AdmissionConfig(enabled=mode == "admission", max_wait_s=args.max_wait))
            agent = AgentProcess(cfg, ["--upstream", url, "--label", label, "--served-name", name], out,
                                 name=f"agent-{mode}")
            log(f"agent-{mode}: " + " ".join(agent.command()))
            with agent:
                load = AgentLoad(agent.url, args.clients, Mix(args.seed, hot_share=args.hot_share),
                                 retry_cap_s=args.retry_cap, seed=args.seed)
                log(f"{mode}: {args.clients} clients for {args.duration:.0f}s")
                asyncio.run(load_for(load, args.duration))
                (out / f"metrics-{mode}.txt").write_text(httpx.get(agent.url + "/metrics", timeout=10).text)
            rows = load.rows()
            write_jsonl(out / f"requests-{mode}.jsonl", rows)
            report["modes"][mode] = summarise(rows, args.slo, args.warmup_s, args.duration)
            log(f"{mode}: " + json.dumps(report["modes"][mode]["fresh_answers"]))
        adm = report["modes"]["admission"]
        report["checks"] = {
            "no 5xx but 503": adm["other_5xx"] == 0 and adm["client_errors"] == 0,
            "every overloaded 503 has Retry-After": adm["overloaded_503"] == adm["overloaded_503_with_retry_after"],
            "fresh answers after warm-up: p50 within the SLO": (adm["fresh_answers_after_warmup"]["p50_s"] or 0)
            <= args.slo,
        }
        report["passed"] = all(report["checks"].values())
        (out / "summary.json").write_text(json.dumps(report, indent=2))
        print(json.dumps({k: v for k, v in report.items() if k != "deployment"}, indent=2))
        return report
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    sys.exit(0 if run(parse_args())["passed"] else 1)


if __name__ == "__main__":
    install_signal_handlers()  # killed (SIGTERM/SIGHUP), it still stops the vLLM servers and the agent it started
    main()
