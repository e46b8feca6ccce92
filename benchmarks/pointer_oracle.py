"""How far a better pointer can take the hybrid: rule ``pointer`` simulated with the bundled pointer and with
an oracle in its place, on the target's greedy replies.

The oracle picks, at every string value's opening, the prompt word whose drafted tokens the reply has (the
longest match among the candidates ``drafting.pointer`` offers), and "no copy" where none has them; its
number picks, its veto and every other step of the rule are the bundled pointer's. The gap between the two
rows is all that any pointer's string picks can add; what is left beyond the oracle is the head's.

    .venv/bin/python benchmarks/pointer_oracle.py [--sets dev:64,handwritten:40,novel:100,test:200]
        [--gamma 3] [--out runs/pointer-oracle.json]

The greedy replies and their features come from ``draft acceptance``'s cache (vLLM offline the first time).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cartspec.draft.acceptance import classes_for, greedy_features, load_data
from cartspec.draft.export import load_head
from cartspec.draft.pipeline import hybrid_config
from cartspec.draft.simulate import head_predictions, simulate_hybrid
from cartspec.draft.train import load_target_weights
from cartspec.drafting.config import for_target
from cartspec.drafting.pointer import Pointer, continuation
from cartspec.drafting.tokens import TokenInfo
from cartspec.model.registry import resolve_head


def oracle(pointer: Pointer, replies: dict[tuple[int, ...], list[int]]) -> Pointer:
    """``pointer`` with its string picks replaced by the oracle's (module doc); ``replies``: each prompt's
    token ids to the whole sequence (prompt + greedy reply)."""
    real = pointer.pick

    def pick(context, prompt_len, k, texts, encode, special, numbers=False):
        if numbers:
            return real(context, prompt_len, k, texts, encode, special, numbers=True)
        truth = replies[tuple(context[:prompt_len])][len(context):len(context) + k]
        c, _ = pointer.probs(context, prompt_len, texts, encode, special)
        best, matched = [], 0
        for j in range(len(c.starts)):
            d = continuation(c, j, k, encode)
            m = 0
            while m < min(len(d), len(truth)) and d[m] == truth[m]:
                m += 1
            if m > matched:
                best, matched = d, m
        return best

    pointer.pick = pick
    return pointer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="dev:64,handwritten:40,novel:100,test:200", help="NAME:N,... (draft data)")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    head = load_head(resolve_head("domain"))
    out = {}
    for spec in args.sets.split(","):
        name, n = spec.split(":")
        reqs = load_data(name, int(n))
        model_dir, tok, records, fs = greedy_features("commerce", reqs, 192, print, False)
        classes = classes_for(tok, reqs, [r["output_ids"] for r in records])
        info = TokenInfo.from_tokenizer(tok)
        preds, probs = head_predictions(head, load_target_weights(model_dir)["embed"].float(), fs, args.gamma)
        cfg = for_target(hybrid_config(target="commerce"), model_dir)
        replies = {}
        for s in range(fs.n_seqs):
            toks = fs.input_ids[fs.seq(s)].tolist()
            replies[tuple(toks[:int(fs.prompt_lens[s])])] = toks
        for mode in ("bundled", "oracle"):
            pointer = Pointer.load(cfg.pointer, model_dir)
            if mode == "oracle":
                pointer = oracle(pointer, replies)
            summary, _ = simulate_hybrid(preds, fs, args.gamma, cfg, classes, info, pointer, probs)
            row = {"tau": summary["tau"], **{c: v["acceptance"] for c, v in summary["by_class"].items() if v["reached"]}}
            out[f"{name}/{mode}"] = row
            print(f"{name:12s} {mode:8s} τ {row['tau']:.4f}  copied values {row.get('value_copied', 0):.3f}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
