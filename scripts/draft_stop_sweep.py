"""Which draft-stop threshold a step-cost model prefers at each batch, from simulated greedy replies.

For every threshold θ in a grid, each request's draft (the bundled head's, γ tokens) is cut where the head's
path probability falls below θ, replayed over the set's greedy replies (``draft.simulate``): the mean kept
draft per step k(θ) and tokens per step τ(θ). A step-cost model (α per step, β per verified token, δ per
draft forward: ``analysis.cost_model.fit_cost_model`` over a study's ``results.jsonl``) then predicts the
decoding throughput at a batch of b requests,

    b·τ(θ) / (α + β·b·(1 + k(θ)) + γ·δ),

and the script prints that rate for every θ, the best θ at each batch, and how close the deployed rule
(``drafting.length.threshold_at``; θ rounded to the grid) comes to it.

    python scripts/draft_stop_sweep.py RESULTS.jsonl [dev] [64] [5]
"""

from __future__ import annotations

import sys

import numpy as np


def main() -> None:
    from cartspec.analysis.cost_model import fit_cost_model
    from cartspec.draft.acceptance import greedy_features, load_data
    from cartspec.draft.export import load_head
    from cartspec.draft.simulate import draft_predictions, simulate_sequence
    from cartspec.draft.train import load_target_weights
    from cartspec.drafting import length
    from cartspec.model.registry import resolve_head
    from cartspec.results import PointResult

    results, data = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "dev")
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    gamma = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    c = fit_cost_model([PointResult.model_validate_json(l) for l in open(results) if l.strip()]).coefficients
    print(f"step costs: α {c.alpha*1e3:.1f} ms, β {c.beta*1e3:.2f} ms/token, δ {c.delta*1e3:.2f} ms/forward, "
          f"ε {c.epsilon*1e3:.2f}; α/β = {c.alpha/c.beta:.1f} tokens")
    model_dir, tok, records, fs = greedy_features("commerce", load_data(data, limit), log=lambda m: None)
    h = load_head(resolve_head("domain"))
    h.eval()
    embed = load_target_weights(model_dir)["embed"].float()
    preds = [draft_predictions(h, embed, fs, s, gamma, with_probs=True) for s in range(fs.n_seqs)]
    grid = [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999]
    stats = {}
    for th in grid + ["g3"]:
        kept = acc = n = 0
        for s, (pred, probs) in enumerate(preds):
            toks = fs.input_ids[fs.seq(s)].tolist()
            P = int(fs.prompt_lens[s])
            lengths = ([3] * len(pred) if th == "g3" else
                       length.kept_lengths(probs, th) if th > 0 else [gamma] * len(pred))
            steps = simulate_sequence(pred, toks, P, gamma, None,
                                      adjust=lambda i, row, L=lengths, P=P: row[:L[i - (P - 1)]])
            # a step with nothing drafted still decodes one token (simulate_sequence skips it)
            n_tok = len(toks) - P
            kept += sum(st.drafted for st in steps)
            acc += sum(st.accepted for st in steps)
            n += n_tok - sum(st.accepted for st in steps)  # engine steps = output tokens - accepted
        stats[th] = (kept / n, (acc + n) / n)
        print(f"θ {th}: kept {kept/n:.2f} drafted a step, τ {(acc+n)/n:.3f}")
    batches = (1, 2, 4, 8, 16, 32)

    def rate(th, b):
        k, tau = stats[th]
        draft = (3 if th == "g3" else gamma) * (c.delta + c.epsilon * b)
        return b * tau / (c.alpha + c.beta * b * (1 + k) + draft)

    def nearest(x):
        return min(grid, key=lambda t: abs(t - x))

    print("\npredicted decoding tok/s at a batch of b requests")
    print("| θ | kept a step | τ | " + " | ".join(f"b={b}" for b in batches) + " |")
    print("|---|---|---|" + "---|" * len(batches))
    print("| plain | 0 | 1 | " + " | ".join(f"{b / (c.alpha + c.beta * b):.1f}" for b in batches) + " |")
    for th in grid + ["g3"]:
        name = "γ=3" if th == "g3" else ("0 (γ=%d)" % gamma if th == 0 else f"{th:g}")
        print(f"| {name} | {stats[th][0]:.2f} | {stats[th][1]:.3f} | "
              + " | ".join(f"{rate(th, b):.1f}" for b in batches) + " |")
    best = {b: max(grid, key=lambda t: rate(t, b)) for b in batches}
    print("best θ: " + ", ".join(f"b={b}: {best[b]:g}" for b in batches))
    dep = {b: length.threshold_at(length.STOP_P, b) for b in batches}
    print(f"deployed rule (θ {length.STOP_P:g} from {length.FULL_BATCH} requests on): "
          + ", ".join(f"b={b}: θ {dep[b]:.2f} ×{rate(nearest(dep[b]), b) / rate(best[b], b):.3f} of best"
                      for b in batches))


if __name__ == "__main__":
    main()
