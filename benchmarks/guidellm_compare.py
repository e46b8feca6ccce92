"""cartspec's load generator against GuideLLM (vllm-project/guidellm) on the same vLLM deployment.

Same deployment, same concurrency, same requests: GuideLLM generates synthetic
prompts of ``--prompt-tokens`` and asks for exactly ``--output-tokens``
(``ignore_eos``); its JSON output records every request body, and cartspec
replays those very messages with the same token budget. Compared: output
throughput, TTFT p50 and TPOT p50 (GuideLLM calls our TPOT "inter-token
latency": (last − first token) / (tokens − 1); its own "TPOT" includes the
first token). Goal: within 10%.

On a small machine the clients get a core of their own and the server computes on
the rest (``--client-cpus``): on 2 cores, GuideLLM's client (several Python
processes) otherwise takes CPU from the very vLLM it measures, and the two tools
would measure different servers. Each tool runs ``--repeats`` times, alternating,
and medians are compared; each tool's own run-to-run spread is reported beside
the difference, so a reader sees the noise floor.

GuideLLM pins click 8.4 (cartspec's venv has a newer one), so it lives in its
own venv: ``python -m venv ~/.cache/cartspec/guidellm-venv &&
~/.cache/cartspec/guidellm-venv/bin/pip install guidellm``; pass its binary with
``--guidellm`` if elsewhere.

    flock /tmp/cartspec-heavy.lock python benchmarks/guidellm_compare.py --model commerce --concurrency 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from statistics import median

from cartspec.bench.loadgen import ChatRequest, LoadConfig, run_load
from cartspec.results import PointConfig, PointResult

DEFAULT_GUIDELLM = Path.home() / ".cache/cartspec/guidellm-venv/bin/guidellm"


def run_guidellm(exe: str, url: str, model: str, tokenizer: str, streams: int, n: int, prompt_tokens: int,
                 output_tokens: int, out: Path, cpus: set[int] | None = None) -> dict:
    cmd = [exe, "run",
           "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/chat/completions",
           "--profile", f"kind=concurrent,streams={streams}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
           "--tokenizer", f"kind=hf_auto,model={tokenizer}",
           "--constraint", f"kind=max_requests,count={n}",
           "--output", f"kind=json,path={out}", "--disable-progress"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                          preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    if proc.returncode != 0:
        raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    data = json.loads(out.read_text())
    bench = data["benchmarks"][0]
    m = bench["metrics"]
    ok = bench["requests"]["successful"]
    return {
        "seconds_incl_startup": time.monotonic() - t0,
        "requests": len(ok), "errors": len(bench["requests"].get("errored") or []),
        "duration_s": bench["duration"],
        "output_throughput": m["output_token_count"]["successful"]["total_sum"] / bench["duration"],
        "output_tokens_per_second_mean": m["output_tokens_per_second"]["successful"]["mean"],
        "ttft_p50": m["time_to_first_token_ms"]["successful"]["median"] / 1000,
        "tpot_p50": m["inter_token_latency_ms"]["successful"]["median"] / 1000,
        "output_tokens_p50": m["output_token_count"]["successful"]["median"],
        "bodies": [json.loads(r["request_args"])["body"] for r in ok],
    }


def run_cartspec(url: str, model: str, bodies: list[dict], streams: int, output_tokens: int,
                 continuous_usage: bool = True) -> dict:
    # GuideLLM asks for usage on every chunk (continuous_usage_stats), which costs the server work per
    # token; by default cartspec sends the very same stream options so both measure the same job.
    stream_options = {"include_usage": True, "continuous_usage_stats": continuous_usage}
    reqs = [ChatRequest(messages=b["messages"], id=str(i), max_tokens=output_tokens,
                        extra={"ignore_eos": True, "stream_options": stream_options}) for i, b in enumerate(bodies)]
    cfg = LoadConfig(concurrency=streams, n_requests=len(reqs), warmup=0)
    res = asyncio.run(run_load(url, model, reqs, cfg))
    point = PointResult.measured(PointConfig(deployment="x", method="none", concurrency=streams,
                                             n_requests=len(reqs)), res.records, res.wall_s, res.acceptance)
    return {"requests": point.n_requests, "errors": point.n_errors, "duration_s": point.wall_s,
            "output_throughput": point.output_throughput, "ttft_p50": point.ttft_p50, "tpot_p50": point.tpot_p50,
            "output_tokens_p50": median(r.output_tokens for r in res.records if r.ok)}


def _median_row(runs: list[dict]) -> dict:
    keys = ("output_throughput", "ttft_p50", "tpot_p50")
    out = {k: median(r[k] for r in runs) for k in keys}
    out["spread"] = {k: max(r[k] for r in runs) / min(r[k] for r in runs) - 1 for k in keys}
    out["requests"] = sum(r["requests"] for r in runs)
    out["errors"] = sum(r["errors"] for r in runs)
    out["output_tokens_p50"] = median(r["output_tokens_p50"] for r in runs)
    out["runs"] = [{k: v for k, v in r.items() if k != "bodies"} for r in runs]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="commerce", help="commerce | base | PATH (started here with vLLM)")
    ap.add_argument("--server", help="an already running endpoint instead (then --tokenizer is required)")
    ap.add_argument("--served-name", default=None)
    ap.add_argument("--tokenizer", help="HF directory whose tokenizer builds the synthetic prompts")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=None, help="per run (default 8 × concurrency, min 12)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per tool, alternating; medians are compared")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--client-cpus", default="auto",
                    help="cores for the two clients; the server computes on the others. 'auto': the last core "
                         "when this machine has at most 8 (a client sharing the server's cores slows the very "
                         "server it measures, and GuideLLM's client costs more CPU than cartspec's); 'none': "
                         "no pinning")
    ap.add_argument("--guidellm", default=shutil.which("guidellm") or str(DEFAULT_GUIDELLM))
    ap.add_argument("--out", type=Path, default=Path("runs/benchmarks"))
    ap.add_argument("--no-continuous-usage", action="store_true",
                    help="cartspec without GuideLLM's per-chunk usage (its own default), to see what that costs")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    from contextlib import nullcontext

    from cartspec.serving.server import VllmServer
    from cartspec.serving.spec import DeploymentSpec

    n_cpu = os.cpu_count() or 1
    if a.client_cpus == "auto":
        client_cpus = {n_cpu - 1} if 1 < n_cpu <= 8 else None
    elif a.client_cpus == "none":
        client_cpus = None
    else:
        client_cpus = {int(x) for x in a.client_cpus.split(",")}
    server_env = {}
    if client_cpus:
        rest = sorted(set(range(n_cpu)) - client_cpus)
        server_env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, rest)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}

    if a.server:
        ctx, url, name, tok = nullcontext(), a.server, a.served_name, a.tokenizer
    else:
        from cartspec.model.registry import resolve_model

        spec = DeploymentSpec(model=a.model, env=server_env)
        server = VllmServer(spec, log_dir=a.out / "logs")
        ctx, url, name, tok = server, server.url, spec.name, a.tokenizer or str(resolve_model(a.model))
    rows = []
    with ctx:
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)  # after the server started: it keeps its own cores
            print(f"clients pinned to cores {sorted(client_cpus)}; server computes on {server_env['VLLM_CPU_OMP_THREADS_BIND']}")
        if name is None:
            from cartspec.serving.endpoint import first_model

            name = first_model(url)
        cu = not a.no_continuous_usage
        for c in [int(x) for x in a.concurrency.split(",")]:
            n = a.requests or max(12, 8 * c)
            g_runs, c_runs = [], []
            for rep in range(a.repeats):
                g = run_guidellm(a.guidellm, url, name, tok, c, n, a.prompt_tokens, a.output_tokens,
                                 a.out / f"guidellm-c{c}-{rep}.json", client_cpus)
                if rep == 0:  # warm the server's shapes for this concurrency once, with the same bodies
                    run_cartspec(url, name, g["bodies"][: max(c, 4)], c, a.output_tokens, cu)
                c_runs.append(run_cartspec(url, name, g["bodies"], c, a.output_tokens, cu))
                g_runs.append(g)
                print(f"  c={c} run {rep + 1}/{a.repeats}: output tok/s guidellm {g['output_throughput']:.1f} "
                      f"cartspec {c_runs[-1]['output_throughput']:.1f}", flush=True)
            gm, cm = _median_row(g_runs), _median_row(c_runs)
            row = {"concurrency": c, "requests_per_run": n, "repeats": a.repeats, "cartspec_continuous_usage": cu,
                   "prompt_tokens": a.prompt_tokens, "output_tokens": a.output_tokens, "guidellm": gm,
                   "cartspec": cm}
            for k in ("output_throughput", "ttft_p50", "tpot_p50"):
                row[f"{k}_diff"] = cm[k] / gm[k] - 1 if gm[k] else None
            rows.append(row)
            print(f"c={c:2d} n={n:3d} x{a.repeats} (medians)  output tok/s: cartspec {cm['output_throughput']:.1f} "
                  f"guidellm {gm['output_throughput']:.1f} ({row['output_throughput_diff']:+.1%}) | TTFT p50: "
                  f"{1000 * cm['ttft_p50']:.0f} vs {1000 * gm['ttft_p50']:.0f} ms ({row['ttft_p50_diff']:+.1%}) | "
                  f"TPOT p50: {1000 * cm['tpot_p50']:.1f} vs {1000 * gm['tpot_p50']:.1f} ms "
                  f"({row['tpot_p50_diff']:+.1%}) | run-to-run spread guidellm "
                  f"{max(gm['spread'].values()):.0%}, cartspec {max(cm['spread'].values()):.0%}", flush=True)
    path = a.out / "guidellm_compare.json"
    path.write_text(json.dumps({"server": url, "model": a.model if not a.server else name,
                                "client_cpus": sorted(client_cpus) if client_cpus else None,
                                "server_env": server_env, "rows": rows}, indent=2))
    within = all(abs(r[f"{k}_diff"]) <= 0.10 for r in rows for k in ("output_throughput", "ttft_p50", "tpot_p50")
                 if r[f"{k}_diff"] is not None)
    print(f"{'within' if within else 'NOT within'} 10% on every metric -> {path}")


if __name__ == "__main__":
    from cartspec.serving.server import install_signal_handlers

    install_signal_handlers()  # killed (SIGTERM/SIGHUP), it still stops the vLLM server it started
    main()
