"""Does constrained decoding (vLLM structured outputs) change speculative acceptance?

Same deployment, same requests, same order, temperature 0: once with
``response_format: json_schema`` (what the agent sends by default), once
without. Per mode: acceptance rate and τ (summed over requests
from vLLM's per-request metrics), schema validity, output tokens, latency.

The grammar can both help (schema tokens become forced, the draft proposes
them) and hurt (vLLM discards draft tokens the grammar rejects), so this is
measured, not argued. Alternating the two modes per batch keeps machine drift
out of the comparison.

    flock /tmp/cartspec-heavy.lock python benchmarks/agent_structured_acceptance.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from cartspec.agent.defaults import default_spec
from cartspec.serving.client import ChatClient, gather_limited
from cartspec.serving.server import VllmServer, install_signal_handlers
from cartspec.serving.spec import Speculative
from cartspec.task.parse import read_reply
from cartspec.task.prompts import messages
from cartspec.task.schema import json_schema
from cartspec.task.generator import generate


async def run_mode(client: ChatClient, reqs, structured: bool, concurrency: int, max_tokens: int) -> list[dict]:
    async def one(req):
        schema = json_schema(req.task) if structured else None
        t = time.perf_counter()
        comp = await client.chat(messages(req), max_tokens=max_tokens, temperature=0.0, json_schema=schema)
        reading = read_reply(req.task, comp.text)
        return {"task": req.task, "seconds": time.perf_counter() - t, "tokens": comp.output_tokens,
                "schema_valid": reading.schema_valid, "typed": reading.value is not None, "spec": comp.request_spec_metrics or {}}

    return await gather_limited((one(r) for r in reqs), concurrency)


def summarise(rows: list[dict]) -> dict:
    ok = [r for r in rows if isinstance(r, dict)]
    steps = sum(r["spec"].get("num_spec_steps", 0) for r in ok)
    drafted = sum(r["spec"].get("num_draft_tokens", 0) for r in ok)
    accepted = sum(r["spec"].get("num_accepted_draft_tokens", 0) for r in ok)
    return {"n": len(ok), "errors": len(rows) - len(ok),
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "tau": round(1 + accepted / steps, 3) if steps else None,
            "drafts": steps, "proposed": drafted, "accepted": accepted,
            "schema_valid": round(sum(r["schema_valid"] for r in ok) / max(len(ok), 1), 3),
            "typed": round(sum(r["typed"] for r in ok) / max(len(ok), 1), 3),
            "mean_output_tokens": round(statistics.mean(r["tokens"] for r in ok), 1) if ok else None,
            "mean_latency_s": round(statistics.mean(r["seconds"] for r in ok), 3) if ok else None}


async def main_async(args, url: str, name: str) -> dict:
    reqs = generate("test", args.n, args.seed)
    results = {True: [], False: []}
    async with ChatClient(url, name, timeout=300) as client:
        await run_mode(client, reqs[:4], True, args.concurrency, args.max_tokens)  # warm-up, not counted
        for i in range(0, len(reqs), args.batch):
            chunk = reqs[i:i + args.batch]
            for structured in ((True, False) if (i // args.batch) % 2 == 0 else (False, True)):
                results[structured] += await run_mode(client, chunk, structured, args.concurrency, args.max_tokens)
    by_task = {}
    for task in ("search", "support"):
        by_task[task] = {mode: summarise([r for r in results[s] if isinstance(r, dict) and r["task"] == task])
                         for mode, s in (("structured", True), ("free", False))}
    return {"structured": summarise(results[True]), "free": summarise(results[False]), "by_task": by_task}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="commerce")
    ap.add_argument("--head", default="auto", help="auto: domain EAGLE-3 head if present, else n-gram")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/agent-structured/summary.json"))
    args = ap.parse_args()
    spec = default_spec(args.model, args.head, args.gamma, enforce_eager=False)
    if spec.speculative.method == "none":  # no head yet: n-gram still shows the grammar's effect on drafts
        spec = spec.model_copy(update={"speculative": Speculative(method="ngram", num_speculative_tokens=args.gamma)})
    with VllmServer(spec, log_dir=args.out.parent / "logs") as server:
        info = server.info()
        report = asyncio.run(main_async(args, server.url, spec.name))
    report = {"spec": spec.model_dump(mode="json"), "versions": info.versions, "n": args.n,
              "concurrency": args.concurrency, **report}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("structured", "free", "by_task")}, indent=2))


if __name__ == "__main__":
    install_signal_handlers()  # killed (SIGTERM/SIGHUP), it still stops the vLLM servers it started
    main()
