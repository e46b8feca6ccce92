"""Sampled speculation on CPU, side by side: plain decoding, a schedule at γ = 0 and EAGLE-3 at γ = 3,
each with cartspec's recovered-token noise (``vllm_plugin/recovered_noise.py``) and with vLLM's own.

Every run is in-process vLLM in a fresh interpreter (the commerce model, the domain head, float32 unless
``--dtype``), one after another: the same seeded T=0.5 requests, ``--batch`` at a time; output tok/s of
the timed part (after a warm-up batch). Run it alone on the machine::

    flock /tmp/cartspec-heavy.lock .venv/bin/python benchmarks/sampled_noise_ab.py --out runs/noise-ab
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RUNS = [("plain", "drafted"), ("k0", "drafted"), ("k0", "vllm"), ("g3", "drafted"), ("g3", "vllm")]


def one(mode: str, n: int, batch: int, temperature: float, dtype: str) -> dict:
    """Runs in the child: one deployment, timed."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # cartspec's vLLM plugin (its fixes, the recovered-noise switch) loads through vLLM's entry point
    from vllm import LLM, SamplingParams

    from cartspec.draft.acceptance import load_data
    from cartspec.model.registry import resolve_head, resolve_model
    from cartspec.serving.engine import resolve_dtype
    from cartspec.task.prompts import messages

    spec = None
    if mode != "plain":
        spec = {"method": "eagle3", "model": str(resolve_head("domain")), "num_speculative_tokens": 3}
        if mode == "k0":
            spec["num_speculative_tokens_per_batch_size"] = [[1, 1024, 0]]
    llm = LLM(model=str(resolve_model("commerce")), dtype=resolve_dtype(dtype), max_model_len=1024,
              max_num_seqs=batch, seed=0, speculative_config=spec)
    convs = [messages(r) for r in load_data("test", n + 8)]
    params = [SamplingParams(temperature=temperature, max_tokens=96, seed=1000 + i) for i in range(len(convs))]
    llm.chat(convs[:8], params[:8], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.chat(convs[8:], params[8:], use_tqdm=False)
    took = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "seconds": round(took, 2), "tok_s": round(tokens / took, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=88)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.5)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(one(args.child, args.requests, args.batch, args.temperature, args.dtype)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    from cartspec.serving.engine import cpu_features

    rows = []
    for mode, noise in RUNS:
        env = {**os.environ, "CARTSPEC_RECOVERED_NOISE": noise}
        cmd = [sys.executable, __file__, "--out", str(args.out), "--child", mode, "--requests", str(args.requests),
               "--batch", str(args.batch), "--temperature", str(args.temperature), "--dtype", args.dtype]
        log = args.out / f"{mode}-{noise}.log"
        print(f"{time.strftime('%H:%M:%S')} {mode} (noise: {noise}) ...", flush=True)
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=fh, text=True, timeout=900)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{mode} ({noise}) failed (exit {proc.returncode}); see {log}")
        rows.append({"deployment": mode, "noise": noise, **json.loads(line[7:])})
        print(f"  {rows[-1]['tok_s']} tok/s ({rows[-1]['tokens']} tokens in {rows[-1]['seconds']} s)", flush=True)
    plain = rows[0]["tok_s"]
    result = {"requests": args.requests, "batch": args.batch, "temperature": args.temperature,
              "cpu_features": cpu_features(), "rows": [{**r, "vs_plain": round(r["tok_s"] / plain, 3)} for r in rows]}
    (args.out / "noise-ab.json").write_text(json.dumps(result, indent=2))
    print(f"{'deployment':10s} {'noise':8s} {'tok/s':>7s} {'x plain':>8s}")
    for r in result["rows"]:
        print(f"{r['deployment']:10s} {r['noise']:8s} {r['tok_s']:7.1f} {r['vs_plain']:8.3f}")


if __name__ == "__main__":
    main()
