"""A traffic log of N novel-kind requests answered by the target offline (vLLM ``LLM.generate``, greedy), in
the format ``cartspec serve --record-traffic`` writes: for timing ``cartspec draft refresh`` on more requests
than a drill plays through the agent in reasonable time.

The replies are the target's own greedy replies to the same chat messages the agent sends, but without the
agent's JSON-schema constraint, and the per-request acceptance fields are zero (no draft ran). Each record
goes through ``TrafficWriter`` (redaction included); timestamps are spaced one second apart, so the refresh's
split by time is well defined. Requests: ``cartspec.task.novel`` at ``--seed`` (default 2), each query once,
none from the novel check set (seed 0).

Heavy (vLLM offline): alone, under the lock:
    flock /tmp/cartspec-heavy.lock .venv/bin/python benchmarks/offline_traffic.py --n 5000 --out runs/traffic-5k
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from cartspec.draft.features import Sampling, vllm_generate
from cartspec.model.registry import resolve_model
from cartspec.task.novel import novel_requests, novel_traffic
from cartspec.task.prompts import messages
from cartspec.task.traffic import TrafficConfig, TrafficRecord, TrafficWriter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--target", default="commerce")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", type=Path, required=True, help="traffic directory to write")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    reqs = novel_traffic(args.n, args.seed, check=novel_requests(100, 0))
    model_dir = resolve_model(args.target)
    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [messages(r) for r in reqs]
    prompts = [tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids for m in msgs]
    t0 = time.perf_counter()
    records = vllm_generate(model_dir, prompts, [Sampling(0.0, max_tokens=args.max_tokens)] * len(prompts),
                            args.out.with_suffix(".generated.jsonl"))
    print(f"{len(reqs)} requests ({len(reqs)} distinct queries) generated in {time.perf_counter() - t0:.0f}s")
    ts0 = time.time() - len(reqs)
    with TrafficWriter(TrafficConfig(dir=args.out)) as w:
        for i, (r, m, rec) in enumerate(zip(reqs, msgs, records)):
            w.write(TrafficRecord(id=f"offline-{i:06d}", ts=ts0 + i, task=r.task, query=r.query, history=r.history,
                                  messages=m, reply=tok.decode(rec["output_ids"], skip_special_tokens=True),
                                  temperature=0.0, structured=False, deployment="offline-greedy",
                                  output_tokens=len(rec["output_ids"])))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
