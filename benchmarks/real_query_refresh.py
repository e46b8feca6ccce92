"""A refresh on real shoppers' queries: the deployed drafter's τ on later held-out real queries after N
recorded requests (the learning curve of docs/refresh.md).

Real queries: Wayfair's WANDS product searches (``cartspec.task.request_sets``): ``real-traffic`` (300) is
what the shop records, ``real`` (180, later queries) is the held-out check set that nothing trains on.

Phases (``--phases``, in this order; each writes OUT/PHASE.json and is skipped when it exists, so a rerun
resumes):

1. ``record``: ``cartspec serve --head domain --record-traffic OUT/traffic`` (the drafter ``serve`` deploys
   by default), the ``real-traffic`` requests once each, ``--clients`` at a time, in order.
2. ``refresh``: for each N of ``--sizes``, the first N records (by time) in a traffic directory of their
   own, and ``cartspec draft refresh --traffic OUT/traffic-N --head REG-N --from domain`` (a registry per N,
   each seeded with the bundled domain head as v0001), timed.
3. ``tau``: ``cartspec draft acceptance --data real --method M --gamma G`` in vLLM for v0001 and every
   refreshed version, with M the hybrid (what ``serve`` deploys) and the head alone: τ and acceptance per
   token class.
4. ``gate``: ``cartspec draft gate`` of the largest N's candidate on its traffic's held-out recent share:
   the deployed drafter, current against candidate, per token class.

Heavy (vLLM and training for many minutes): alone, under the lock, from the repository root:
    flock /tmp/cartspec-heavy.lock .venv/bin/python benchmarks/real_query_refresh.py --out runs/real-refresh
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

from agent_drill_lib import AgentLoad, Fixed, log, run_logged as run
from cartspec.agent.config import AgentConfig
from cartspec.agent.process import AgentProcess
from cartspec.machine import cpu_features, hardware
from cartspec.model.heads import HeadRegistry
from cartspec.private_files import open_private, private_dir
from cartspec.serving.server import install_signal_handlers
from cartspec.task.request_sets import real_requests
from cartspec.task.traffic import read_traffic

PHASES = ("record", "refresh", "tau", "gate")
CLI = [sys.executable, "-m", "cartspec.cli"]


def first_records(src: Path, dst: Path, n: int) -> int:
    """The first ``n`` records of the traffic in ``src``, by time, as one owner-only traffic file in ``dst``."""
    records = sorted(read_traffic(src), key=lambda r: r.ts)[:n]
    private_dir(dst)
    with open_private(dst / "traffic-first.jsonl", "w") as fh:
        for r in records:
            fh.write(r.model_dump_json() + "\n")
    return len(records)


def report_figures(path: Path) -> dict:
    """τ, the acceptance per token class and the drafter's settings of a ``draft acceptance`` report."""
    from cartspec.draft.acceptance import AcceptanceReport

    rep = AcceptanceReport.load(path)
    return {"tau": rep.tau, "n": rep.n, "hybrid": rep.hybrid,
            "by_class": {c: {"acceptance": v.acceptance, "reached": v.reached} for c, v in rep.by_class.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/real-refresh"))
    ap.add_argument("--registry", default="real", help="registry name prefix: REG-N for each size")
    ap.add_argument("--sizes", default="100,300", help="recorded requests each refresh learns from")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--methods", default="hybrid,eagle3")
    ap.add_argument("--refresh-args", default="", help="extra flags for every refresh")
    ap.add_argument("--phases", default=",".join(PHASES))
    args = ap.parse_args()
    install_signal_handlers()
    out = args.out
    private_dir(out)
    phases = [p for p in args.phases.split(",") if p]
    sizes = [int(x) for x in args.sizes.split(",") if x]
    methods = [m for m in args.methods.split(",") if m]
    done = lambda p: (out / f"{p}.json").exists()  # noqa: E731
    save = lambda p, d: (out / f"{p}.json").write_text(json.dumps(d, indent=2))  # noqa: E731
    machine = {"hardware": hardware(), "cpu_features": list(cpu_features()), "cores": os.cpu_count()}
    traffic = out / "traffic"

    if "record" in phases and not done("record"):
        reqs = real_requests("real-traffic")
        cfg = AgentConfig().model_copy(update={"trace_path": out / "trace-record.jsonl"})
        with AgentProcess(cfg, ["--head", "domain", "--record-traffic", str(traffic)], out_dir=out,
                          name="agent-record", start_timeout_s=900) as agent:
            log(f"record: agent up at {agent.url}; {len(reqs)} real requests, {args.clients} clients")
            load = AgentLoad(agent.url, args.clients, Fixed(reqs), n_items=len(reqs))
            t0 = time.time()
            asyncio.run(load.run_each())
            secs = time.time() - t0
        rows = load.rows()
        save("record", {"machine": machine, "requests": len(reqs), "answered": sum(r["status"] == 200 for r in rows),
                        "seconds": round(secs, 1), "recorded": len(read_traffic(traffic))})
        log(f"record: {len(rows)} answered in {secs:.0f}s")

    if "refresh" in phases and not done("refresh"):
        figures = {}
        for n in sizes:
            name = f"{args.registry}-{n}"
            sub = out / f"traffic-{n}"
            kept = first_records(traffic, sub, n)
            secs = run(CLI + ["draft", "refresh", "--traffic", str(sub), "--head", name, "--from", "domain",
                              *shlex.split(args.refresh_args)], out / f"refresh-{n}.log")
            v = HeadRegistry(name).versions()[-1]
            figures[str(n)] = {"records": kept, "version": v.ref, "seconds": round(secs, 1),
                               "training": v.provenance.get("training"), "vocab": v.provenance.get("vocab"),
                               "pointer": v.provenance.get("pointer"), "records_split": v.provenance.get("records")}
        save("refresh", {"machine": machine, "figures": figures})

    if "tau" in phases and not done("tau"):
        refreshed = json.loads((out / "refresh.json").read_text())["figures"]
        heads = {"v0001 (the bundled domain head)": "domain"}  # every registry's v0001: its copy
        heads.update({f"refreshed on {n}": f["version"] for n, f in refreshed.items()})
        figures = {}
        for label, ref in heads.items():
            for m in methods:
                path = out / f"real-{ref.replace('@', '-')}-{m}-g{args.gamma}.json"
                secs = 0.0  # a report an earlier run wrote is kept (a rerun resumes)
                if not path.exists():
                    secs = run(CLI + ["draft", "acceptance", "--data", "real", "--method", m, "--head", ref,
                                      "--gamma", str(args.gamma), "--out", str(path)], out / f"{path.stem}.log")
                figures[f"{label} / {m}"] = {**report_figures(path), "ref": ref, "seconds": round(secs, 1),
                                             "report": path.name}
        save("tau", {"machine": machine, "gamma": args.gamma, "data": "real", "figures": figures})

    if "gate" in phases and not done("gate"):
        n = max(sizes)
        name = f"{args.registry}-{n}"
        cand = HeadRegistry(name).versions()[-1].version
        secs = run(CLI + ["draft", "gate", "--head", name, "--candidate", cand, "--traffic", str(out / f"traffic-{n}"),
                          "--gamma", str(args.gamma), "--out", str(out / "gate-decision.json")], out / "gate.log")
        save("gate", {"machine": machine, "head": name, "candidate": cand, "seconds": round(secs, 1),
                      "decision": json.loads((out / "gate-decision.json").read_text())})

    for p in PHASES:
        if done(p):
            print(f"== {p}\n" + (out / f"{p}.json").read_text())


if __name__ == "__main__":
    main()
