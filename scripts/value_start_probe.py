"""Where the head ranks a reply value's first token (an experiment for the hybrid's copied values).

The hybrid's copied values are mostly lost at a value's first token: the context ends in the value's
opening quote, the head drafts a wrong word, and no lookup can know which of the prompt's words the
reply takes. This probe asks whether the head's own ranking could pick it: at every value start of the
target's greedy replies (the simulator's teacher-forced chains, `draft.simulate`), the rank of the true
token in the head's top-20, whether it is in the prompt, and a rule that replaces the head's first
token by its best-ranked candidate found in the prompt (a token or its leading-space twin), only where
the head's own first token is not in the prompt, its probability is at most MAX_P and the candidate's is
at least RATIO × it. Prints per token class the counts, and the rule's gain in correct first tokens.
Then a pointer: the head's output scored against the target's lm_head rows of the prompt's content
tokens (and twins), drafted vocabulary or not, its pick replacing the head's where the head's first
token is not in the prompt and no more likely than MAX_P.

    .venv/bin/python scripts/value_start_probe.py test 200
"""
import collections
import sys

import torch

from cartspec.draft.acceptance import classes_for, greedy_features, load_data
from cartspec.draft.export import load_head
from cartspec.draft.train import load_target_weights
from cartspec.model.registry import resolve_head
from cartspec.drafting import TokenInfo, value_open

K = 20
data = sys.argv[1] if len(sys.argv) > 1 else "test"
limit = int(sys.argv[2]) if len(sys.argv) > 2 else 200
reqs = load_data(data, limit)
model_dir, tok, records, fs = greedy_features("commerce", reqs, 192, print, False)
classes = classes_for(tok, reqs, [r["output_ids"] for r in records])
info = TokenInfo.from_tokenizer(tok)
head = load_head(resolve_head("domain"))
head.eval()
target = load_target_weights(model_dir)
embed = target["embed"].float()
lm = target["lm_head"].float()  # the head's own lm_head started as these rows (``draft.train.init_head``)
rows = []
with torch.no_grad():
    for s in range(fs.n_seqs):
        sl = fs.seq(s)
        L, P = sl.stop - sl.start, int(fs.prompt_lens[s])
        toks = fs.input_ids[sl].tolist()
        # value starts: position j whose context toks[:j] ends in the value's opening quote
        js = [j for j in range(P + 1, L) if value_open(toks[:j], P, info) == j - 1]
        if not js:
            continue
        starts = torch.tensor([(0, j - 2) for j in js], dtype=torch.long)  # chain start j-2 drafts toks[j] first
        out = head.unroll(embed, fs.input_ids[sl].long()[None], fs.aux[sl].float()[None], torch.tensor([L]),
                          starts, 1)[0]
        probs, ids = out["logits"].float().softmax(-1).topk(K, -1)
        cands = head.to_target(ids)
        prompt = set(toks[:P])
        in_prompt = lambda t: t in prompt or int(info.twin[t]) in prompt  # noqa: E731
        # the pointer: the head's output scored against the target's lm_head rows of the prompt's content
        # tokens and their leading-space twins (any of them, drafted vocabulary or not)
        pool = sorted({x for t in prompt for x in (t, int(info.twin[t])) if x >= 0 and bool(info.content[x])})
        full = head.norm(out["hidden"].float()) @ lm[pool].T  # [n, |pool|]
        order = full.argsort(-1, descending=True)
        for n, j in enumerate(js):
            c = cands[n].tolist()
            ranked = [pool[i] for i in order[n].tolist()]
            rows.append(dict(cls=classes[s][j - P], true=toks[j], rank=c.index(toks[j]) if toks[j] in c else -1,
                             in_prompt=in_prompt(toks[j]), cands=c, probs=probs[n].tolist(),
                             ok=[in_prompt(x) and bool(info.content[x]) for x in c],
                             ptr=ranked[0], ptr_rank=ranked.index(toks[j]) if toks[j] in ranked else -1))


def pick(r, max_p, ratio):
    c, p, ok = r["cands"], r["probs"], r["ok"]
    if ok[0] or p[0] > max_p:
        return c[0]
    return next((x for x, good, q in zip(c, ok, p) if good and q >= ratio * p[0]), c[0])


print(f"value starts of {len(rows)} values in {fs.n_seqs} greedy replies ({data}, head domain, top-{K})")
by = collections.defaultdict(collections.Counter)
for r in rows:
    b = by[r["cls"]]
    b["n"] += 1
    b["top1"] += r["rank"] == 0
    b["top5"] += 0 <= r["rank"] < 5
    b[f"top{K}"] += r["rank"] >= 0
    b["in_prompt"] += r["in_prompt"]
    b["ptr_top1"] += r["ptr_rank"] == 0
    b["ptr_top3"] += 0 <= r["ptr_rank"] < 3
for cls, b in sorted(by.items()):
    print(f"  {cls:22s} " + " ".join(f"{k}={v}" for k, v in b.items()))
print("rule: correct first tokens gained (+) or lost (-) against the head's top-1, per class")
for max_p in (0.3, 0.5, 0.7, 1.0):
    for ratio in (0.0, 0.05, 0.1, 0.2):
        hit = collections.Counter(r["cls"] for r in rows if pick(r, max_p, ratio) == r["true"])
        gain = {cls: hit[cls] - b["top1"] for cls, b in sorted(by.items())}
        print(f"  max_p={max_p:.1f} ratio={ratio:.2f} " + " ".join(f"{k}={v:+d}" for k, v in gain.items()))
print("pointer: the head's top-1 replaced by the pointer's pick where it is not in the prompt and its "
      "probability is at most max_p; gained (+) or lost (-) per class")
for max_p in (0.3, 0.5, 0.7, 0.9, 1.0):
    hit = collections.Counter(r["cls"] for r in rows
                              if (r["ptr"] if not r["ok"][0] and r["probs"][0] <= max_p else r["cands"][0]) == r["true"])
    gain = {cls: hit[cls] - b["top1"] for cls, b in sorted(by.items())}
    print(f"  max_p={max_p:.1f} " + " ".join(f"{k}={v:+d}" for k, v in gain.items()))
