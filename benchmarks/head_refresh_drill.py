"""The head's life after launch, drilled: record traffic of a new kind, refresh, gate, canary, promote; then a
worse candidate, and its rollback.

Traffic the domain head was not trained on: the novel set's kind (``cartspec.task.novel``: held-out
phrasings with products, brands, colours and materials in no generator pool), requests never repeated.
The held-out check set is the novel set itself (``--data novel``: seed 0); the traffic comes from seed 1,
without any request whose query is in the check set.

Phases (``--phases``, in this order; each writes OUT/PHASE.json and skips when it exists, so a rerun
resumes):

1. ``record``: ``cartspec serve --head REG --draft eagle3 --gamma 3 --record-traffic OUT/traffic``; the
   first ``--record-n`` requests, ``--clients`` at a time.
2. ``refresh``: ``cartspec draft refresh --traffic OUT/traffic --head REG`` -> a candidate version (timed).
3. ``gate``: ``cartspec draft gate --head REG --candidate V --traffic OUT/traffic`` (held-out recent traffic).
4. ``canary``: serve REG's current with ``--canary-head REG@V --canary-share S``; the next ``--canary-n``
   requests; the canary promotes (or not). Timeline: share per head over time, when it decided, on what.
5. ``worse``: a deliberately worse candidate (``draft refresh --init fresh --steps 8``), canaried on the next
   ``--worse-n`` requests after a restart (which must serve the promoted version): it must roll back.
6. ``tau``: ``cartspec draft acceptance --data novel --gamma 3`` for the head before (REG@v0001) and the
   promoted one: τ and per-class acceptance in vLLM on the held-out set.

Heavy (vLLM for many minutes, a training run): alone, under the lock, from the repository root:
    flock /tmp/cartspec-heavy.lock .venv/bin/python benchmarks/head_refresh_drill.py --out runs/drill-refresh
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path

import httpx
from agent_drill_lib import AgentLoad, Fixed, log, run_logged as run, write_jsonl
from cartspec.agent.config import AgentConfig
from cartspec.agent.process import AgentProcess
from cartspec.agent.trace import read_trace
from cartspec.machine import cpu_features, hardware
from cartspec.model.heads import HeadRegistry
from cartspec.results import percentile
from cartspec.serving.server import install_signal_handlers
from cartspec.task.novel import novel_requests, novel_traffic

PHASES = ("record", "refresh", "gate", "canary", "worse", "tau")
CLI = [sys.executable, "-m", "cartspec.cli"]


def traffic_requests(n_total: int, seed: int = 1) -> list:
    """Novel-kind requests, each query once, none whose query is in the check set (novel seed 0)."""
    try:
        return novel_traffic(n_total, seed, check=novel_requests(100, 0), pool=max(3 * n_total, 3000))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def serve_args(reg: str, gamma: int, extra: list[str]) -> list[str]:
    return ["--head", reg, "--draft", "eagle3", "--gamma", str(gamma), *extra]


def play(out: Path, name: str, reqs: list, clients: int, args_: list[str], cfg: AgentConfig) -> dict:
    """Serve with ``args_``, send every request once, return the rows (client side joined with the trace)."""
    trace = out / f"trace-{name}.jsonl"
    cfg = cfg.model_copy(update={"trace_path": trace})
    with AgentProcess(cfg, args_, out_dir=out, name=f"agent-{name}", start_timeout_s=900) as agent:
        log(f"{name}: agent up at {agent.url}; {len(reqs)} requests, {clients} clients")
        load = AgentLoad(agent.url, clients, Fixed(reqs), n_items=len(reqs))
        t0 = time.time()
        asyncio.run(load.run_each())
        log(f"{name}: {len(load.records)} answered in {time.time() - t0:.0f}s")
        info = httpx.get(agent.url + "/v1/info", timeout=10).json()
        (out / f"metrics-{name}.txt").write_text(httpx.get(agent.url + "/metrics", timeout=10).text)
    traced = {t["id"]: t for t in read_trace(trace)}
    rows = []
    for r in sorted(load.rows(), key=lambda r: r["start"]):
        t = traced.get(r["id"], {})
        spec = t.get("spec") or {}
        rows.append({**r, "route": t.get("route"), "head_version": t.get("head_version"),
                     "canary_trace": t.get("canary"), "accepted": spec.get("accepted"),
                     "proposed": spec.get("proposed"), "drafts": spec.get("drafts")})
    write_jsonl(out / f"requests-{name}.jsonl", rows)
    return {"rows": rows, "info": info}


def timeline(rows: list[dict], bucket: int) -> dict:
    """Share of traffic per route in consecutive buckets of requests, when the canary decided, latency around it."""
    def lat(rs):
        xs = [r["latency_s"] for r in rs if r["status"] == 200]
        return {"n": len(xs), "p50_s": percentile(xs, 50), "p95_s": percentile(xs, 95)}

    def tau(rs):
        d = sum(r["drafts"] or 0 for r in rs)
        return round(1 + sum(r["accepted"] or 0 for r in rs) / d, 3) if d else None

    buckets = []
    for i in range(0, len(rows), bucket):
        rs = rows[i:i + bucket]
        routes = sorted({r["route"] or "?" for r in rs})
        buckets.append({"requests": [i, i + len(rs)], "t_s": [round(rs[0]["start"], 1), round(rs[-1]["end"], 1)],
                        "share": {k: round(sum((r["route"] or "?") == k for r in rs) / len(rs), 3) for k in routes},
                        "head_versions": sorted({r["head_version"] or "-" for r in rs}),
                        "states": sorted({(r["canary"] or "").split(";")[1].strip() if ";" in (r["canary"] or "")
                                          else (r["canary"] or "-") for r in rs})})
    # the decision is made when the reply that completed the trial is answered (its header says decision=)
    decided = next((i for i, r in enumerate(rows) if "decision=" in (r["canary"] or "")), None)
    t_dec = rows[decided]["end"] if decided is not None else None
    before = [r for r in rows if t_dec is None or r["start"] < t_dec]
    after = [r for r in rows if t_dec is not None and r["start"] >= t_dec]
    return {
        "buckets": buckets,
        "decision_request": decided,  # index by start time of the reply that made the decision
        "decided_at_s": round(t_dec, 1) if t_dec is not None else None,
        "decision_header": rows[decided]["canary"] if decided is not None else None,
        "requests_before_decision": len(before),
        "routes_after_decision": {k: sum((r["route"] or "?") == k for r in after)
                                  for k in sorted({r["route"] or "?" for r in after})},
        "tau_by_route_before": {k: tau([r for r in before if r["route"] == k]) for k in ("speculative", "candidate")},
        "latency": {"before_decision": lat(before), "after_decision": lat(after),
                    "candidate_during_trial": lat([r for r in before if r["route"] == "candidate"]),
                    "current_during_trial": lat([r for r in before if r["route"] == "speculative"])},
        "statuses": {str(s): sum(r["status"] == s for r in rows) for s in sorted({r["status"] for r in rows})},
        "answered_all": all(r["status"] == 200 for r in rows),
    }


def replies_identical(out: Path, ref_a: str, ref_b: str, gamma: int) -> str:
    """Of the check set's replies drafted by two heads (``draft acceptance`` saves their token ids), how many are
    the same tokens: the replies are the target's whoever drafts, so at T=0 all should be."""
    a, b = (json.loads((out / f"novel-{ref.replace('@', '-')}-g{gamma}.json").read_text())["replies"]
            for ref in (ref_a, ref_b))
    ids_b = {r["id"]: r["token_ids"] for r in b}
    return f"{sum(ids_b.get(r['id']) == r['token_ids'] for r in a)}/{len(a)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/drill-refresh"))
    ap.add_argument("--registry", default="shop", help="head registry name (seeded from the bundled domain head)")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--record-n", type=int, default=1000)
    ap.add_argument("--canary-n", type=int, default=400)
    ap.add_argument("--worse-n", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--share", type=float, default=0.25, help="canary share (the drill's; serve's default is 0.1)")
    ap.add_argument("--min-requests", type=int, default=40, help="candidate replies before promotion")
    ap.add_argument("--refresh-args", default="", help="extra flags for the refresh, e.g. '--max-minutes 8'")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--resummarize", action="store_true",
                    help="recompute the canary and worse timelines from their requests-*.jsonl, run nothing")
    args = ap.parse_args()
    install_signal_handlers()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    phases = [p for p in args.phases.split(",") if p]
    reg = HeadRegistry(args.registry)
    if not reg.exists():
        run(CLI + ["heads", "add", args.registry, "domain", "--current"], out / "heads-add.log")
    n_all = args.record_n + args.canary_n + args.worse_n
    reqs = traffic_requests(n_all)
    rec_reqs = reqs[:args.record_n]
    can_reqs = reqs[args.record_n:args.record_n + args.canary_n]
    worse_reqs = reqs[args.record_n + args.canary_n:]
    cfg = AgentConfig()
    cfg = cfg.model_copy(update={"canary": cfg.canary.model_copy(update={"min_requests": args.min_requests})})
    traffic = out / "traffic"
    done = lambda p: (out / f"{p}.json").exists()  # noqa: E731
    save = lambda p, d: (out / f"{p}.json").write_text(json.dumps(d, indent=2))  # noqa: E731
    machine = {"hardware": hardware(), "cpu_features": list(cpu_features()), "cores": os.cpu_count()}

    if args.resummarize:
        for p in ("canary", "worse"):
            if done(p):
                rows = [json.loads(x) for x in (out / f"requests-{p}.jsonl").read_text().splitlines() if x.strip()]
                old = json.loads((out / f"{p}.json").read_text())
                old.pop("decided_at_request", None)  # the timeline's field before it counted from the decision
                save(p, {**old, **timeline(sorted(rows, key=lambda r: r["start"]), 25)})
        if done("tau"):
            tau = json.loads((out / "tau.json").read_text())
            first, cand = list(tau["figures"])[:2]
            save("tau", {**tau, "replies_identical": replies_identical(out, first, cand, tau["gamma"])})
        return
    if "record" in phases and not done("record"):
        before = reg.current()
        res = play(out, "record", rec_reqs, args.clients, serve_args(args.registry, args.gamma,
                   ["--record-traffic", str(traffic)]), cfg)
        rows = res["rows"]
        save("record", {"machine": machine, "head": before.ref if before else None, "requests": len(rows),
                        "answered_all": all(r["status"] == 200 for r in rows),
                        "tau": timeline(rows, max(1, len(rows)))["tau_by_route_before"],
                        "wall_s": round(max(r["end"] for r in rows), 1)})
    if "refresh" in phases and not done("refresh"):
        parent = reg.current()
        secs = run(CLI + ["draft", "refresh", "--traffic", str(traffic), "--head", args.registry,
                          *shlex.split(args.refresh_args)], out / "refresh.log")
        cand = reg.versions()[-1]
        save("refresh", {"seconds": round(secs, 1), "parent": parent.ref, "candidate": cand.ref,
                         "provenance": cand.provenance})
    cand_ref = json.loads((out / "refresh.json").read_text())["candidate"] if done("refresh") else None
    if "gate" in phases and not done("gate") and cand_ref:
        secs = run(CLI + ["draft", "gate", "--head", args.registry, "--candidate", cand_ref.split("@")[1],
                          "--traffic", str(traffic), "--gamma", str(args.gamma),
                          "--out", str(out / "gate-decision.json")],
                   out / "gate.log")
        save("gate", {"seconds": round(secs, 1), **json.loads((out / "gate-decision.json").read_text())})
    if "canary" in phases and not done("canary") and cand_ref:
        res = play(out, "canary", can_reqs, args.clients, serve_args(args.registry, args.gamma, [
            "--canary-head", cand_ref, "--canary-share", str(args.share)]), cfg)
        cur = reg.current()
        save("canary", {"candidate": cand_ref, "current_after": cur.ref if cur else None,
                        "canary_info": res["info"].get("canary"), **timeline(res["rows"], 25),
                        "events": reg.events()[-3:]})
    if "worse" in phases and not done("worse"):
        secs = run(CLI + ["draft", "refresh", "--traffic", str(traffic), "--head", args.registry, "--init", "fresh",
                          "--steps", "8"], out / "refresh-worse.log")
        worse = reg.versions()[-1]
        cur = reg.current()
        res = play(out, "worse", worse_reqs, args.clients, serve_args(args.registry, args.gamma, [
            "--canary-head", worse.ref, "--canary-share", str(args.share)]), cfg)
        save("worse", {"refresh_seconds": round(secs, 1), "candidate": worse.ref,
                       "served_after_restart": cur.ref if cur else None,
                       "status_after": reg.get(worse.version).status, "canary_info": res["info"].get("canary"),
                       **timeline(res["rows"], 25), "events": reg.events()[-3:]})
    if "tau" in phases and not done("tau") and cand_ref:
        first = reg.versions()[0].ref
        figures = {}
        for ref in (first, cand_ref):
            dest = out / f"novel-{ref.replace('@', '-')}-g{args.gamma}.json"
            run(CLI + ["draft", "acceptance", "--method", "eagle3", "--head", ref, "--data", "novel",
                       "--gamma", str(args.gamma), "--out", str(dest)], out / f"{dest.stem}.log")
            rep = json.loads(dest.read_text())
            figures[ref] = {"tau": rep.get("tau"), "acceptance_rate": rep.get("acceptance_rate"),
                            "by_class": {k: v.get("acceptance") for k, v in rep.get("by_class", {}).items()}}
        save("tau", {"data": "novel (seed 0, 100 requests; never in the traffic)", "gamma": args.gamma,
                     "figures": figures, "replies_identical": replies_identical(out, first, cand_ref, args.gamma),
                     "machine": machine})
    for p in PHASES:
        if done(p):
            print(f"--- {p}: {out / (p + '.json')}")


if __name__ == "__main__":
    main()
