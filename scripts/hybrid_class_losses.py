"""Where the hybrid loses a token class the head alone keeps (an experiment behind the head's gate).

Replays the head alone and rule ``pointer`` (``drafting.rules``, the simulator's chains,
``draft.simulate``) on the target's greedy replies and places every output token of CLASS in one of
three states per drafter: accepted (a draft of it was accepted), rejected (a draft of it was the step's
rejected one) or bonus (never drafted: the target's token after all γ drafts were accepted). Prints the
3×3 table head state × hybrid state, then the tokens the head alone accepted and the hybrid rejected,
with the hybrid's draft, the head's draft from the same chain start and the head's probabilities, and
how many of them the hybrid had replaced at that very position ("replaced-at").

    .venv/bin/python scripts/hybrid_class_losses.py test 200 3 0      # HEAD_P 0: without the gate
    .venv/bin/python scripts/hybrid_class_losses.py novel 100 5 0.9   # the gate at 0.9
"""
import collections
import sys

from cartspec.draft.acceptance import classes_for, greedy_features, load_data
from cartspec.draft.export import load_head
from cartspec.drafting.pointer import Pointer
from cartspec.draft.simulate import head_predictions
from cartspec.draft.train import load_target_weights
from cartspec.model.registry import resolve_head, resolve_pointer
from cartspec.drafting import HybridConfig, TokenInfo, propose

data = sys.argv[1] if len(sys.argv) > 1 else "test"
limit = int(sys.argv[2]) if len(sys.argv) > 2 else 200
gamma = int(sys.argv[3]) if len(sys.argv) > 3 else 3
head_p = float(sys.argv[4]) if len(sys.argv) > 4 else 0.9
CLASS = sys.argv[5] if len(sys.argv) > 5 else "value_not_in_request"

reqs = load_data(data, limit)
model_dir, tok, records, fs = greedy_features("commerce", reqs, 192, log=lambda m: None)
classes = classes_for(tok, reqs, [r["output_ids"] for r in records])
head = load_head(resolve_head("domain"))
preds, probs = head_predictions(head, load_target_weights(model_dir)["embed"].float(), fs, gamma)
info = TokenInfo.from_tokenizer(tok)
cfg = HybridConfig(rule="pointer", head_p=head_p)
pointer = Pointer.load(resolve_pointer(""), model_dir)


def walk(s: int, hybrid: bool) -> dict[int, tuple]:
    """Output position -> (state, chain start, draft, head's draft, head's probabilities, position)."""
    toks = fs.input_ids[fs.seq(s)].tolist()
    P, L = int(fs.prompt_lens[s]), len(toks)
    out, i = {}, P - 1
    while i + 2 < L:
        row = [int(t) for t in preds[s][i - (P - 1)]]
        conf = probs[s][i - (P - 1)].tolist()
        draft = propose(row, toks[:i + 2], P, cfg, info, pointer, conf) if hybrid else row
        a = 0
        while a < gamma and i + 2 + a < L and draft[a] == toks[i + 2 + a]:
            a += 1
        for k in range(min(a + 1, gamma, L - i - 2)):
            out[i + 2 + k] = ("accepted" if k < a else "rejected", i, draft, row, conf, k)
        i += a + 1
    return out


table = collections.Counter()
lost = []
for s in range(fs.n_seqs):
    toks = fs.input_ids[fs.seq(s)].tolist()
    P = int(fs.prompt_lens[s])
    alone, hyb = walk(s, False), walk(s, True)
    for pos in range(P + 1, len(toks)):
        if classes[s][pos - P] != CLASS:
            continue
        a, h = alone.get(pos, ("bonus",)), hyb.get(pos, ("bonus",))
        table[(a[0], h[0])] += 1
        if a[0] == "accepted" and h[0] == "rejected":
            lost.append((s, toks, P, h))

print(f"{data} {limit} γ={gamma} head_p={head_p} {CLASS}: head alone (rows) × hybrid (columns)")
states = ("accepted", "rejected", "bonus")
print(f"{'':10s}" + "".join(f"{c:>10s}" for c in states))
for r in states:
    print(f"{r:10s}" + "".join(f"{table[(r, c)]:10d}" for c in states))
kinds = collections.Counter()
for s, toks, P, (_, i, draft, row, conf, k) in lost:
    kind = "replaced-before" if draft[:k] != row[:k] else ("replaced-at" if draft[k] != row[k] else "head-wrong")
    kinds[kind] += 1
    print(s, repr(tok.decode(toks[max(P, i - 10):i + 2])), "| true", repr(tok.decode(toks[i + 2:i + 2 + gamma])),
          "| hybrid", repr(tok.decode(draft)), "| head", repr(tok.decode(row)), [round(c, 2) for c in conf], kind)
print(f"lost (head accepted, hybrid rejected): {len(lost)} {dict(kinds)}")
