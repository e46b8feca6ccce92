"""Does vLLM's per-batch-size schedule cost anything at equal γ? T=0, BATCH streams, in-process vLLM: fixed γ=K
(``fixedK``) against the schedule ``[[1,1024,K]]`` with ``num_speculative_tokens: max(K, 5)`` (``schedK``), as an
adaptive deployment whose schedule tops out at 5 runs at γ=K. Same requests, same drafts; output tok/s over at
least 24 requests (six batches, or more for small batches). Run the two modes alternately, alone on the machine::

    for m in fixed3 sched3 fixed3 sched3; do
      flock /tmp/cartspec-heavy.lock .venv/bin/python benchmarks/schedule_ab.py $m 8 runs/sched-ab-$m-$RANDOM.json
    done
"""
import json, os, re, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
# cartspec's vLLM plugin loads through vLLM's entry point (vllm.general_plugins) when the engine starts
from cartspec.model.registry import resolve_model, resolve_head
from cartspec.draft.acceptance import load_data
from cartspec.task.prompts import messages
from vllm import LLM, SamplingParams
m = re.fullmatch(r"(fixed|sched)([1-9])", sys.argv[1]) if len(sys.argv) == 4 else None
if not m or not sys.argv[2].isdigit():
    sys.exit("usage: schedule_ab.py fixedK|schedK BATCH OUT.json   (K: 1-9)")
mode, batch, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
k = int(m.group(2))
spec = {"method": "eagle3", "model": str(resolve_head("domain")),
        "num_speculative_tokens": max(k, 5) if m.group(1) == "sched" else k}
if m.group(1) == "sched":
    spec["num_speculative_tokens_per_batch_size"] = [[1, 1024, k]]
llm = LLM(model=str(resolve_model("commerce")), dtype="float32", max_model_len=1024, max_num_seqs=batch, seed=0,
          speculative_config=spec)
rounds = max(6, 24 // batch)  # at least 24 requests
convs = [messages(r) for r in load_data("test", 8 + rounds * batch)]
p = SamplingParams(temperature=0.0, max_tokens=96)
llm.chat(convs[:8], p, use_tqdm=False)
t0 = time.perf_counter(); toks = 0
for i in range(rounds):
    o = llm.chat(convs[8 + i * batch: 8 + (i + 1) * batch], p, use_tqdm=False)
    toks += sum(len(x.outputs[0].token_ids) for x in o)
took = time.perf_counter() - t0
res = {"mode": mode, "batch": batch, "tokens": toks, "s": round(took, 2), "tok_s": round(toks / took, 1)}
json.dump(res, open(out, "w")); print(json.dumps(res))
