"""Regenerate responses with vLLM offline, in its own process.

``python -m cartspec.draft.vllm_generate JOB.json OUT.jsonl``. The job holds the
model directory, token-id prompts and one sampling setting per prompt; each
output line is ``{"i", "prompt_ids", "output_ids", "finish_reason"}``. Run as a
subprocess so vLLM's spawned workers and its KV-cache reservation never live in
the caller (a training process or a test).
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    job = json.loads(open(job_path).read())
    llm = LLM(model=job["model"], dtype=job.get("dtype", "bfloat16"), max_model_len=job.get("max_model_len", 1024),
              enforce_eager=job.get("enforce_eager", False), seed=job.get("seed", 0),
              max_num_seqs=job.get("max_num_seqs", 64))
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    params = [SamplingParams(temperature=s["temperature"], top_p=s.get("top_p", 1.0), max_tokens=s["max_tokens"],
                             seed=s.get("seed")) for s in job["sampling"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - t0
    n_tok = 0
    with open(out_path, "w") as fh:
        for i, o in enumerate(outs):
            c = o.outputs[0]
            n_tok += len(c.token_ids)
            fh.write(json.dumps({"i": i, "prompt_ids": list(o.prompt_token_ids), "output_ids": list(c.token_ids),
                                 "finish_reason": c.finish_reason}) + "\n")
    print(json.dumps({"generated_tokens": n_tok, "seconds": round(took, 1),
                      "tokens_per_s": round(n_tok / max(took, 1e-9), 1)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
