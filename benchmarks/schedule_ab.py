"""Does vLLM's per-batch-size schedule cost anything at equal γ? T=0, BATCH streams, in-process vLLM: fixed γ=3
(``fixed3``) against the schedule ``[[1,1024,3]]`` with ``num_speculative_tokens: 5`` (``sched3``), as an adaptive
deployment whose schedule tops out at 5 runs at γ=3. Same requests, same drafts; output tok/s of six batches.
Run the two modes alternately, alone on the machine::

    for m in fixed3 sched3 fixed3 sched3; do
      flock /tmp/cartspec-heavy.lock .venv/bin/python benchmarks/schedule_ab.py $m 8 runs/sched-ab-$m-$RANDOM.json
    done
"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
from cartspec.serving import vllm_fixes
vllm_fixes.install()
from cartspec.model.registry import resolve_model, resolve_head
from cartspec.draft.acceptance import load_data
from cartspec.task.prompts import messages
from vllm import LLM, SamplingParams
if len(sys.argv) != 4 or sys.argv[1] not in ("fixed3", "sched3") or not sys.argv[2].isdigit():
    sys.exit("usage: schedule_ab.py fixed3|sched3 BATCH OUT.json")
mode, batch, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
spec = {"method": "eagle3", "model": str(resolve_head("domain")), "num_speculative_tokens": 5 if mode == "sched3" else 3}
if mode == "sched3":
    spec["num_speculative_tokens_per_batch_size"] = [[1, 1024, 3]]
llm = LLM(model=str(resolve_model("commerce")), dtype="float32", max_model_len=1024, max_num_seqs=batch, seed=0,
          speculative_config=spec)
convs = [messages(r) for r in load_data("test", 8 + 6 * batch)]
p = SamplingParams(temperature=0.0, max_tokens=96)
llm.chat(convs[:8], p, use_tqdm=False)
t0 = time.perf_counter(); toks = 0
for k in range(6):
    o = llm.chat(convs[8 + k * batch: 8 + (k + 1) * batch], p, use_tqdm=False)
    toks += sum(len(x.outputs[0].token_ids) for x in o)
took = time.perf_counter() - t0
res = {"mode": mode, "batch": batch, "tokens": toks, "s": round(took, 2), "tok_s": round(toks / took, 1)}
json.dump(res, open(out, "w")); print(json.dumps(res))
