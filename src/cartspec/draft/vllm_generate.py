"""Regenerate responses with vLLM offline, in its own process.

``python -m cartspec.draft.vllm_generate JOB.json OUT.jsonl``. The job holds the
model directory, token-id prompts and one sampling setting per prompt; each
output line is ``{"i", "prompt_ids", "output_ids", "finish_reason"}``. Run as a
subprocess so vLLM's spawned workers and its KV-cache reservation never live in
the caller (a training process or a test). While it runs, progress goes to
stdout as JSON lines (``LineProgress``), and the last line is the run's figures.
"""

from __future__ import annotations

import io
import json
import sys
import time

from tqdm import tqdm

# a progress line at most this often (and at the end)
PROGRESS_EVERY_S = 15.0


class LineProgress(tqdm):
    """vLLM's progress bar (``LLM.generate(use_tqdm=...)`` takes the class) as JSON lines on stdout,
    ``{"progress": done, "total": n, "elapsed_s": s}``, at most one every ``PROGRESS_EVERY_S`` seconds and
    one at the end, for the caller to relay; the bar itself is drawn nowhere."""

    def __init__(self, *args, **kwargs):
        kwargs["file"] = io.StringIO()
        super().__init__(*args, **kwargs)
        self._said = time.monotonic()

    def update(self, n=1):
        out = super().update(n)
        now = time.monotonic()
        if now - self._said >= PROGRESS_EVERY_S or (self.total and self.n >= self.total):
            self._said = now
            print(json.dumps({"progress": self.n, "total": self.total,
                              "elapsed_s": round(self.format_dict["elapsed"], 1)}), flush=True)
        return out


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
    outs = llm.generate(prompts, params, use_tqdm=LineProgress)
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
