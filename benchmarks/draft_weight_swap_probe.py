"""Probe: swap the EAGLE-3 draft head's weights inside a running vLLM engine, without a restart.

One offline ``vllm.LLM`` (CPU build) with ``{"method": "eagle3", "model": HEAD_A}`` answers ``--n`` novel
requests greedily; then the draft model's weights are replaced in place by HEAD_B's, and the same requests
run again. With ``--compare-fresh`` a fresh engine built with HEAD_B answers them too: the swap worked when
the swapped engine's acceptance equals the fresh one's (greedy, same prompts, same batch, cold prefix cache).

How the swap is done (vLLM 0.32.0; see the report for file:line references). vLLM's public routes do not
reach the draft on CPU: ``LLM.collective_rpc("reload_weights")`` reloads the *target* only
(``GPUModelRunner.reload_weights`` uses ``self.get_model()``), and the draft-aware weight-transfer API
(``start_draft_weight_update`` / ``update_weights``) needs a ``weight_transfer_config`` whose backends
(nccl, ipc, ...) are CUDA-only. So ``LLM.collective_rpc`` ships ``swap_draft_weights`` (below) to the
worker, which does what those weight-transfer engines do around a checkpoint-format update:
``initialize_layerwise_reload(draft)``, ``draft.load_weights(B's tensors)``,
``finalize_layerwise_reload(draft, draft_model_config)``. The layerwise reload matters on CPU: after loading,
vLLM prepacks every linear weight (oneDNN / sgl kernels) and replaces ``layer.weight`` by an empty tensor,
so a bare ``load_weights`` would fail (and would not reach the packed copy); the layerwise reload restores
the original shapes from metadata recorded at model init and re-runs ``process_weights_after_loading``.
The draft's ``embed_tokens`` is the *target's* module (shared at load: the head has none), so it is
detached from the draft for the duration of the swap; a head that carries its own embeddings is refused.
Afterwards the prefix cache is reset: cached blocks hold the draft layer's KV computed by HEAD_A.

Only heads of the same architecture can be swapped: the draft vocabulary size fixes the shape of
``lm_head``, ``draft_id_to_target_id`` and the logits processor at build time (8192 vs 8245 cannot be
swapped; restart the engine for that). The probe refuses such a pair before starting vLLM.

Each engine runs in its own child process (``--child``), one after the other. Heavy (vLLM for minutes):
alone on the machine, from the repository root::

    flock /tmp/cartspec-heavy.lock .venv/bin/python benchmarks/draft_weight_swap_probe.py \\
        --target MODEL_DIR --head-a HEAD_A --head-b HEAD_B --enforce-eager --compare-fresh
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WEIGHTS = "model.safetensors"
# Config keys the built draft model bakes in (module shapes, norms, rotary, aux layers the target captures):
# two heads that differ in any of them cannot share one engine.
ARCH_KEYS = ("architectures", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "num_hidden_layers", "vocab_size", "draft_vocab_size", "target_hidden_size",
             "hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
             "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
             "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "logit_scale", "eagle_config")
COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


# --- compatibility (no vLLM) ------------------------------------------------------------

def head_tensors(head_dir: Path) -> dict[str, tuple[list[int], str]]:
    from safetensors import safe_open

    with safe_open(str(Path(head_dir) / WEIGHTS), "pt") as f:
        return {k: (list(f.get_slice(k).get_shape()), str(f.get_slice(k).get_dtype())) for k in f.keys()}


def swap_refusals(head_a: Path, head_b: Path) -> list[str]:
    """Why HEAD_B's weights cannot be loaded into an engine built with HEAD_A (empty: they can)."""
    ca = json.loads((head_a / "config.json").read_text())
    cb = json.loads((head_b / "config.json").read_text())
    reasons = []
    dva, dvb = ca.get("draft_vocab_size") or ca.get("vocab_size"), cb.get("draft_vocab_size") or cb.get("vocab_size")
    if dva != dvb:
        reasons.append(
            f"draft vocabulary size differs ({dva} vs {dvb}): vLLM sizes the draft's lm_head "
            f"(ParallelLMHead({dva}, ...)), its draft_id_to_target_id parameter ([{dva}]) and its "
            f"LogitsProcessor({dva}) when the engine is built, and the lm_head weight loader asserts the "
            f"loaded rows equal {dva}; an in-place swap cannot resize them. Restart the engine with the new "
            f"head, or keep the draft vocabulary size fixed across head versions")
    for k in ARCH_KEYS:
        if k != "draft_vocab_size" and ca.get(k) != cb.get(k):
            reasons.append(f"config {k!r} differs ({ca.get(k)!r} vs {cb.get(k)!r}): fixed when the engine is built")
    ta, tb = head_tensors(head_a), head_tensors(head_b)
    if any("embed_tokens" in k for k in tb):
        reasons.append("HEAD_B carries its own embed_tokens; the swap only handles heads that share the "
                       "target's embedding (cartspec's export writes none)")
    if set(ta) != set(tb):
        reasons.append(f"tensor names differ: only in A {sorted(set(ta) - set(tb))}, "
                       f"only in B {sorted(set(tb) - set(ta))}")
    shape_diff = [f"{k}: {ta[k][0]} vs {tb[k][0]}" for k in sorted(set(ta) & set(tb)) if ta[k][0] != tb[k][0]]
    if shape_diff:
        reasons.append("tensor shapes differ: " + "; ".join(shape_diff))
    return reasons


# --- runs in the worker (shipped by LLM.collective_rpc; module-level so it pickles) ----

def swap_draft_weights(worker, head_dir: str) -> dict:
    """Load HEAD_DIR's weights into the worker's live EAGLE-3 draft model, in place."""
    import time as _time

    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    t0 = _time.perf_counter()
    model = worker.get_draft_model()  # model_runner.drafter.model, unwrapped
    spec = worker.speculative_config
    if model is None or spec is None or spec.draft_model_config is None:
        raise RuntimeError("this engine has no draft model")
    state = load_file(str(Path(head_dir) / WEIGHTS))
    t_read = _time.perf_counter()

    # Re-check against the live model: what the engine was built with, not what HEAD_A's files say.
    draft_vocab = int(model.config.draft_vocab_size)
    rows = int(state["lm_head.weight"].shape[0])
    if rows != draft_vocab:
        raise ValueError(f"{head_dir}: lm_head has {rows} rows, the running draft was built for {draft_vocab}")
    d2t = getattr(model, "draft_id_to_target_id", None)
    if (d2t is None) != ("d2t" not in state) or (d2t is not None and tuple(d2t.shape) != tuple(state["d2t"].shape)):
        raise ValueError(f"{head_dir}: d2t {tuple(state['d2t'].shape) if 'd2t' in state else None} does not fit "
                         f"the running draft's draft_id_to_target_id {None if d2t is None else tuple(d2t.shape)}")
    if any("embed_tokens" in k for k in state):
        raise ValueError(f"{head_dir}: carries embed_tokens; the running draft shares the target's")

    inner = model.model
    shared_embed = inner._modules.get("embed_tokens")
    inner._modules["embed_tokens"] = None  # the target's module: keep it out of the reload
    try:
        with set_current_vllm_config(worker.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            model.load_weights(state.items())
            finalize_layerwise_reload(model, spec.draft_model_config)
    finally:
        inner._modules["embed_tokens"] = shared_embed
    t_load = _time.perf_counter()

    # What can be checked directly: lm_head (kept unpacked on CPU), d2t and the norms. The linear layers are
    # prepacked (their .weight is empty); the fresh-engine comparison checks those.
    def same(live, ref) -> bool:
        live = live.detach()
        return bool(torch.equal(live[: ref.shape[0]].to(torch.float32).cpu(), ref.to(torch.float32)))

    checks = {"lm_head": same(model.lm_head.weight, state["lm_head.weight"]),
              "norm": same(inner.norm.weight, state["norm.weight"])}
    if d2t is not None:
        checks["d2t"] = bool(torch.equal(d2t.detach().cpu(), state["d2t"].to(d2t.dtype)))
    if "midlayer.hidden_norm.weight" in state and hasattr(inner.layers[0], "hidden_norm"):
        checks["hidden_norm"] = same(inner.layers[0].hidden_norm.weight, state["midlayer.hidden_norm.weight"])
    checks["embed_still_target"] = inner.embed_tokens is shared_embed
    return {"read_s": round(t_read - t0, 4), "load_process_s": round(t_load - t_read, 4),
            "worker_s": round(t_load - t0, 4), "checks": checks}


# --- one engine (child process) ------------------------------------------------------

def acceptance(before, after, outs) -> dict:
    """Acceptance over one ``generate`` from the engine's counters before and after (``SpecCounters``), and
    a digest of the target's outputs."""
    st = (after - before).stats()
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return {"num_drafts": st.steps if st else 0, "num_draft_tokens": st.drafted if st else 0,
            "num_accepted_tokens": st.accepted if st else 0,
            "acceptance_rate": round(st.rate, 4) if st and st.rate is not None else None,
            "mean_acceptance_length": round(st.tau, 4) if st and st.tau is not None else None,
            "per_position": [round(p, 4) for p in st.per_position_rate] if st else [],
            "output_tokens": sum(len(x) for x in ids),
            "outputs_sha": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}


def run_child(mode: str, args) -> dict:
    import vllm  # cartspec's vLLM plugin loads through vLLM's entry point when the engine starts
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from cartspec.bench.metrics import SpecCounters
    from cartspec.serving.engine import resolve_dtype
    from cartspec.task.novel import novel_requests
    from cartspec.task.prompts import render

    head = args.head_a if mode == "swap" else args.head_b
    tok = AutoTokenizer.from_pretrained(args.target)
    prompts = [{"prompt_token_ids": tok(render(tok, r), add_special_tokens=False).input_ids}
               for r in novel_requests(args.n, 0)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    llm = LLM(model=str(args.target), dtype=resolve_dtype(args.dtype), max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, seed=0, enforce_eager=args.enforce_eager,
              disable_log_stats=False,  # get_metrics() asserts stat logging (llm_engine.py)
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": args.gamma})
    res = {"vllm": vllm.__version__, "head": str(head), "build_s": round(time.perf_counter() - t0, 1)}

    def measure(tag: str) -> None:
        before = SpecCounters.from_vllm_metrics(llm.get_metrics())
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = SpecCounters.from_vllm_metrics(llm.get_metrics())
        res[tag] = {**acceptance(before, after, outs), "wall_s": round(time.perf_counter() - t, 1)}

    measure("head_a" if mode == "swap" else "head_b_fresh")
    if mode == "swap":
        t = time.perf_counter()
        worker = llm.collective_rpc(swap_draft_weights, args=(str(args.head_b),))
        t_rpc = time.perf_counter()
        llm.reset_prefix_cache()  # cached blocks hold draft-layer KV computed by HEAD_A
        res["swap"] = {"rpc_s": round(t_rpc - t, 4), "total_s": round(time.perf_counter() - t, 4),
                       "workers": worker}
        measure("head_b_swapped")
    return res


# --- parent ----------------------------------------------------------------------------

def child_env(args) -> dict[str, str]:
    from cartspec.serving.engine import engine_env, kv_cache_gib, resolve_dtype

    env = {**os.environ, **engine_env()}
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # a fitted KV cache, as `cartspec serve` does
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib(args.target, resolve_dtype(args.dtype), args.max_num_seqs,
                                                         args.max_model_len, args.head_a))
    if args.multiprocessing:
        # engine core (and, on CPU, the worker) in other processes: the function crosses msgpack, which
        # pickles callables only with this set (vllm/v1/serial_utils.py)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    else:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in the child itself
    return env


def run_in_child(mode: str, args, log_dir: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--target", str(args.target), "--head-a", str(args.head_a),
           "--head-b", str(args.head_b), "--n", str(args.n), "--max-tokens", str(args.max_tokens),
           "--gamma", str(args.gamma), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--enforce-eager"] if args.enforce_eager else []
    cmd += ["--multiprocessing"] if args.multiprocessing else []
    log = log_dir / f"{mode}.log"
    print(f"{time.strftime('%H:%M:%S')} {mode} engine ... (log: {log})", file=sys.stderr, flush=True)
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, env=child_env(args), stdout=subprocess.PIPE, stderr=fh, text=True,
                              timeout=args.timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{mode} run failed (exit {proc.returncode}); see {log}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="target model directory")
    ap.add_argument("--head-a", type=Path, required=True,
                    help="EAGLE-3 head the engine is built with (a directory or REGISTRY@vN)")
    ap.add_argument("--head-b", type=Path, required=True, help="EAGLE-3 head swapped in (a directory or REGISTRY@vN)")
    ap.add_argument("--n", type=int, default=20, help="novel requests (cartspec.task.novel, seed 0)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no torch.compile (the safe setting for in-place weight changes)")
    ap.add_argument("--compare-fresh", action="store_true", help="also build a fresh engine with HEAD_B")
    ap.add_argument("--multiprocessing", action="store_true",
                    help="vLLM's default process layout (engine core + worker in other processes) instead of "
                         "everything in the child; the swap function is then pickled")
    ap.add_argument("--force", action="store_true", help="heads recorded for another target: warn, go on")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON summary here")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per engine run")
    ap.add_argument("--child", choices=("swap", "fresh"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_child(args.child, args)), flush=True)
        return

    from cartspec.model.registry import check_head, resolve_head, resolve_model

    args.target = resolve_model(str(args.target))
    args.head_a, args.head_b = resolve_head(str(args.head_a)), resolve_head(str(args.head_b))
    for h in (args.head_a, args.head_b):
        check_head(h, args.target, force=args.force, warn=lambda m: print(m, file=sys.stderr))
    summary: dict = {"target": str(args.target), "head_a": str(args.head_a), "head_b": str(args.head_b),
                     "n": args.n, "max_tokens": args.max_tokens, "gamma": args.gamma, "dtype": args.dtype,
                     "enforce_eager": args.enforce_eager, "multiprocessing": args.multiprocessing}
    refusals = swap_refusals(args.head_a, args.head_b)
    if refusals:
        summary.update(refused=True, reasons=refusals)
        print(json.dumps(summary, indent=2))
        sys.exit("refusing: HEAD_B's weights do not fit an engine built with HEAD_A (reasons above)")

    log_dir = (args.out.parent if args.out else Path("runs")) / "draft-weight-swap-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    swap = run_in_child("swap", args, log_dir)
    summary.update(vllm=swap["vllm"], build_s=swap["build_s"], swap_seconds=swap["swap"]["total_s"],
                   swap=swap["swap"], before=swap["head_a"], after=swap["head_b_swapped"])
    if args.compare_fresh:
        fresh = run_in_child("fresh", args, log_dir)
        summary["fresh"] = fresh["head_b_fresh"]
        a, f = summary["after"], summary["fresh"]
        summary["swap_matches_fresh"] = {
            "acceptance_rate": a["acceptance_rate"] == f["acceptance_rate"],
            "counters": all(a[k] == f[k] for k in COUNTS),
            "target_outputs": a["outputs_sha"] == f["outputs_sha"],
        }
    text = json.dumps(summary, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
