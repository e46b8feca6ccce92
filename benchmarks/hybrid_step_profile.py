"""The hybrid's own per-step work, timed alone: what ``vllm_plugin.hybrid.hybrid_drafts`` adds to a verify
step on top of the head's draft, at 1, 8 and 32 requests in the batch.

It replays the gold replies of test-split requests (prompt + reply token ids) through the same function the
plugin calls in vLLM's runner, with a stand-in for the runner's input batch (the token rows, the counts, the
accepted tokens of the step) and the head's draft taken from the reply itself (the next k tokens, with every
third request's draft shifted by one so that copies and head disagree as they do in practice). Each step
advances every request by an accepted count drawn from a fixed seed. Nothing else runs: no model forward, so
the figures are the hybrid's Python and numpy work per step, which runs on the same cores as the model.

    .venv/bin/python benchmarks/hybrid_step_profile.py --out runs/hybrid-profile.json [--profile]

``--profile`` adds cProfile's top functions at batch 8 (``PROFILE_SORT=cumulative`` and ``PROFILE_TOP=N`` in the
environment change the order and the count; by default the 25 with the most time of their own). Each batch size's row records a digest of every draft
(``drafts_sha256``, of the last pass): a change that should draft the same tokens, run before and after,
gives the same digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/hybrid-profile.json"))
    ap.add_argument("--requests", type=int, default=64, help="test-split requests replayed")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rule", default="pointer")
    ap.add_argument("--repeats", type=int, default=3, help="passes over the replies per batch size")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from cartspec.draft.acceptance import load_data
    from cartspec.draft.pointer import Pointer, sequences_from_gold
    from cartspec.machine import engine_versions
    from cartspec.model.registry import resolve_model, resolve_pointer

    try:
        from cartspec.drafting import HybridConfig, TokenInfo
        from cartspec.vllm_plugin.hybrid import hybrid_drafts
    except ImportError:  # a version before the drafting package (run with PYTHONPATH=OLD/src for "before")
        from cartspec.serving.hybrid import HybridConfig, TokenInfo, hybrid_drafts

    torch.set_num_threads(1)
    model = resolve_model("commerce")
    tok = AutoTokenizer.from_pretrained(model)
    seqs = sequences_from_gold(tok, load_data("test", limit=args.requests)[:args.requests])
    cfg = HybridConfig(rule=args.rule)
    info = TokenInfo.from_tokenizer(tok)
    try:
        from cartspec.drafting.config import NEEDS_POINTER, NEEDS_SCHEMA
    except ImportError:  # an older version: only rule ``pointer`` read the pointer, none a schema
        NEEDS_POINTER, NEEDS_SCHEMA = ("pointer",), ()
    pointer = Pointer.load(resolve_pointer(None), model) if args.rule in NEEDS_POINTER else None
    vllm_config = None
    if args.rule in NEEDS_SCHEMA:  # the runner's schemas: the deployment's default, the commerce replies'
        from cartspec.task.schema import reply_schema
        from cartspec.vllm_plugin.schema import KEY as SCHEMA_KEY

        vllm_config = types.SimpleNamespace(additional_config={SCHEMA_KEY: {"schema": reply_schema()}},
                                            model_config=types.SimpleNamespace(model=str(model), tokenizer=str(model)))
    runner_extra = {}  # kept across steps as a runner keeps its attributes (the compiled schema, made once)
    k = args.gamma
    import cartspec

    out = {"source": str(Path(cartspec.__file__).parent), "rule": args.rule, "gamma": k, "requests": len(seqs), "machine": engine_versions(), "batches": {}}

    digests: dict[int, str] = {}

    def run_batch(B: int, seed: int) -> list[float]:
        """Per-step seconds of ``hybrid_drafts`` over the replies, B requests at a time."""
        rng = random.Random(seed)
        times = []
        digest = hashlib.sha256()  # of every draft: two versions that draft alike give the same
        order = list(range(len(seqs)))
        rng.shuffle(order)
        for start in range(0, len(order), B):
            group = [seqs[i] for i in order[start:start + B]]
            if len(group) < B:
                group += [seqs[i] for i in order[:B - len(group)]]
            L = max(len(t) for t, _ in group)
            rows = np.zeros((B, L + 2 * k + 4), dtype=np.int64)  # room for the last step's draft
            for i, (t, _) in enumerate(group):
                rows[i, :len(t)] = t
            pos = [p for _, p in group]  # tokens known to the runner (prompt, then accepted)
            ends = [len(t) for t, _ in group]
            last = [1] * B  # tokens accepted at the previous step (the first comes from the prefill)
            while True:
                live = [i for i in range(B) if pos[i] + last[i] < ends[i] - 1]
                if not live:
                    break
                batch = types.SimpleNamespace(num_reqs=B, token_ids_cpu=rows,
                                              num_tokens_no_spec=np.array(pos, dtype=np.int64),
                                              num_prompt_tokens=np.array([p for _, p in group], dtype=np.int64),
                                              vocab_size=len(tok), req_ids=[f"r{start + i}" for i in range(B)])
                runner = types.SimpleNamespace(input_batch=batch, vllm_config=vllm_config, requests={},
                                               discard_request_mask=types.SimpleNamespace(np=np.zeros(B, bool)),
                                               **runner_extra)
                sampled = torch.full((B, k + 1), -1, dtype=torch.int64)
                heads = torch.zeros((B, k), dtype=torch.int64)
                for i in range(B):
                    n = last[i]
                    sampled[i, :n] = torch.from_numpy(rows[i, pos[i]:pos[i] + n])
                    nxt = pos[i] + n
                    shift = 1 if i % 3 == 2 else 0  # a head that is off by one: copies and head disagree
                    heads[i] = torch.from_numpy(rows[i, nxt + shift:nxt + shift + k])
                t0 = time.perf_counter()
                drafts = hybrid_drafts(runner, heads, sampled, cfg, info, pointer)
                times.append(time.perf_counter() - t0)
                digest.update(np.asarray(drafts, dtype=np.int64).tobytes())
                for kept in ("_cartspec_schemas", "_cartspec_prompts"):  # made once, kept by a runner
                    if hasattr(runner, kept):
                        runner_extra[kept] = getattr(runner, kept)
                for i in range(B):
                    pos[i] = min(pos[i] + last[i], ends[i] - 1)
                    last[i] = 1 + rng.choice(range(k + 1))
        digests[B] = digest.hexdigest()[:16]
        return times

    def cold() -> None:
        """Empty every per-context and per-prompt cache: a server meets each value's opening once."""
        import importlib

        try:  # the prompts' text, n-gram index and candidate words, kept per prompt
            importlib.import_module("cartspec.drafting.prompt").clear()
        except ImportError:  # a version before drafting.prompt kept them in two caches of its own
            importlib.import_module("cartspec.drafting.lookup")._INDEX.clear()
            importlib.import_module("cartspec.drafting.pointer")._PROMPTS.clear()
        runner_extra.pop("_cartspec_prompts", None)  # each request's Prompt, kept by the runner
        if pointer is not None:
            pointer._memo.clear()
        if "_cartspec_schemas" in runner_extra:  # each request's grammar track
            for g in runner_extra["_cartspec_schemas"].grammars.values():
                g._tracks.clear()

    run_batch(1, 99)  # the first call's imports and allocations
    for B in [int(x) for x in args.batches.split(",")]:
        passes = []
        for s in range(args.repeats):
            cold()
            passes.append(run_batch(B, s))
        means = [statistics.fmean(p) for p in passes]
        steps = passes[0]
        row = {"mean_ms": round(1000 * statistics.median(means), 3),
               "median_ms": round(1000 * statistics.median([statistics.median(p) for p in passes]), 3),
               "p90_ms": round(1000 * sorted(steps)[int(0.9 * len(steps))], 3),
               "per_request_us": round(1e6 * statistics.median(means) / B, 1), "steps": len(steps),
               "pass_means_ms": [round(1000 * x, 3) for x in means]}
        row["drafts_sha256"] = digests[B]
        out["batches"][str(B)] = row
        print(f"batch {B:>2}: {row['mean_ms']:.3f} ms per step (median {row['median_ms']:.3f}, p90 {row['p90_ms']:.3f}), "
              f"{row['per_request_us']:.0f} us per request, drafts {row['drafts_sha256']}", flush=True)

    if args.profile:
        import cProfile
        import io
        import pstats

        cold()
        pr = cProfile.Profile()
        pr.enable()
        run_batch(8, 1)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(os.environ.get("PROFILE_SORT", "tottime")).print_stats(int(os.environ.get("PROFILE_TOP", "25")))
        out["profile_b8"] = s.getvalue()
        print(s.getvalue())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"-> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
