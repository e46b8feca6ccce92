"""Where a deployment's engine steps spend their time, inside vLLM: cProfile over offline generation.

vLLM's engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with cartspec's plugin
loaded as in a server (vLLM's entry point), so cProfile sees the model runner, the drafter and every
cartspec patch. One deployment label per run (the study's labels: ``eagle3:domain:5``,
``eagle3:domain:5:stop``, ``hybrid:domain:3``, ...); ``--batch`` requests at once (vLLM's
``max_num_seqs``), ``--n`` test-split requests after one warm-up batch. Prints output tok/s, the per-step
drafting and verifying times (patch ``step_stats``), and with ``--profile`` cProfile's top functions;
``--out`` keeps the step file and the raw profile (``LABEL.pstats``, for ``pstats`` callers/callees).
``--timers`` times, over the measured requests, vLLM's drafter (``SpecDecodeBaseProposer.propose``: the
head's forwards) and cartspec's hybrid drafter (``vllm_plugin.hybrid.hybrid_drafts``: the rules per request,
and ``recorded_probs``: the gate's probabilities, inside it), ms per call, that is per step, and Python's
garbage collections by generation (``gc0``, ``gc1``, ``gc2``: count and ms each, wherever they ran: a
drafter's allocations can set off a collection that the model's step then pays for).

    .venv/bin/python benchmarks/engine_step_profile.py eagle3:domain:5:stop --batch 8 --profile

Run one at a time (``flock /tmp/cartspec-heavy.lock``), compare labels back to back, and rerun: on two
shared cores two runs of the same label differ by several percent. cProfile's own cost falls on the Python
work (the drafters), so compare profiles with profiles and timings without.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("label", help="a study deployment label, e.g. eagle3:domain:5:stop")
    ap.add_argument("--model", default="commerce")
    ap.add_argument("--n", type=int, default=64, help="measured test-split requests")
    ap.add_argument("--batch", type=int, default=8, help="requests at once (vLLM's max_num_seqs)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", type=Path, default=Path("runs/engine-profile"))
    ap.add_argument("--profile", action="store_true", help="cProfile the measured requests")
    ap.add_argument("--timers", action="store_true", help="time the drafter and the hybrid's own work (module doc)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from cartspec.serving.engine import engine_env

    os.environ.update(engine_env())
    from cartspec.bench.plan import parse_deployment
    from cartspec.machine import resolve_dtype
    from cartspec.serving.server import VllmServer
    from cartspec.task.generator import generate
    from cartspec.task.prompts import messages
    from cartspec.vllm_plugin import steps

    spec = parse_deployment(args.label, args.model).model_copy(update={"max_num_seqs": args.batch})
    model, head = VllmServer(spec, log_dir=args.out)._resolve()
    step_file = args.out / f"{spec.label}.steps.json"
    os.environ[steps.ENV] = str(step_file.resolve())
    kw = dict(model=str(model), dtype=resolve_dtype(spec.dtype), max_model_len=spec.max_model_len,
              max_num_seqs=args.batch, seed=spec.seed)
    if extra := spec.speculative.additional_config(str(model)):
        kw["additional_config"] = extra
    if sc := spec.speculative.vllm_config(head):
        kw["speculative_config"] = sc

    timers = install_timers() if args.timers else None

    from vllm import LLM, SamplingParams

    llm = LLM(**kw)
    msgs = [messages(r) for r in generate("test", args.n + args.batch, 0)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    llm.chat(msgs[args.n:], sp, use_tqdm=False)  # warm-up: compiled shapes, caches
    time.sleep(steps.EVERY_S)
    before = steps.read(step_file)
    if timers is not None:
        timers.clear()
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    outs = llm.chat(msgs[:args.n], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    timed = {k: {"calls": n, "ms_per_call": round(1000 * t / max(n, 1), 3)} for k, (n, t) in (timers or {}).items()}
    # the step file is written at most every EVERY_S: run one more short batch so that it holds the last steps
    time.sleep(steps.EVERY_S)
    llm.chat(msgs[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    by = steps.difference(steps.read(step_file), before)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"label": spec.label, "batch": args.batch, "requests": args.n, "seconds": round(dt, 2),
           "output_tokens": tokens, "tok_s": round(tokens / dt, 1), "steps": steps.summary(by)}
    if timers is not None:
        row["timers"] = timed
    print(json.dumps(row))
    if prof is not None:
        prof.dump_stats(args.out / f"{spec.label}.pstats")
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())


def install_timers() -> dict:
    """Wrap vLLM's drafter and cartspec's hybrid drafter with timers (module doc); returns ``{name: [calls,
    seconds]}``, filled as they run (cleared by the caller to start the measured window)."""
    import collections
    import functools

    import cartspec.vllm_plugin.hybrid as hybrid
    import vllm.v1.spec_decode.llm_base_proposer as proposer

    timers: dict = collections.defaultdict(lambda: [0, 0.0])

    def timed(owner, name, key):
        f = getattr(owner, name)

        @functools.wraps(f)
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                row = timers[key]
                row[0] += 1
                row[1] += time.perf_counter() - t

        setattr(owner, name, wrapper)

    timed(proposer.SpecDecodeBaseProposer, "propose", "vllm_drafter")
    timed(hybrid, "hybrid_drafts", "hybrid_drafts")  # the runner's wrap calls it by its module-level name
    timed(hybrid, "recorded_probs", "gate_probs")

    import gc

    started = [0.0]

    def collections(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            row = timers[f"gc{info['generation']}"]
            row[0] += 1
            row[1] += time.perf_counter() - started[0]

    gc.callbacks.append(collections)
    return timers


if __name__ == "__main__":
    main()
