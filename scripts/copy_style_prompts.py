"""Head training prompts that ask for copying (an experiment on the draft head's copied-value class).

N_TRAIN train-split requests plus N_COPY train-style requests whose products, brands, colours and materials are replaced by words in no generator pool and not in the
novel set (single-word vocabulary entries of the tokenizer), so the target's replies copy words the head
never saw as values. Writes cartspec request lines, for `cartspec draft train --kind domain --prompts OUT.jsonl`.

    .venv/bin/python scripts/copy_style_prompts.py 1200 400 runs/copy-mix.jsonl
"""
import json, random, re, sys
from transformers import AutoTokenizer
from cartspec.model.registry import resolve_model
from cartspec.task import generator as g, novel
from cartspec.task.generator import generate

if len(sys.argv) != 4:
    sys.exit("usage: copy_style_prompts.py N_TRAIN N_COPY OUT.jsonl")
n_train, n_copy, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
taken = set()
for pools in (g.PRODUCTS, g.BRANDS, g.MATERIALS, g.SIZES):
    for pool in pools.values():
        for w in pool.seen + pool.held:
            taken |= set(re.findall(r"[a-z0-9]+", w.lower()))
for c in g.COLORS.seen + g.COLORS.held:
    taken |= set(re.findall(r"[a-z0-9]+", c.lower()))
taken |= {p for w in novel.all_novel_words() for p in re.findall(r"[a-z0-9]+", w)}
tok = AutoTokenizer.from_pretrained(str(resolve_model("commerce")))
words = sorted({t[1:].lower() for t in tok.convert_ids_to_tokens(range(len(tok)))
                if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower() and 5 <= len(t) - 1 <= 10} - taken)
rng = random.Random(17)
rng.shuffle(words)
pool = tuple(words[:3000])
cats = list(novel.NOVEL_PRODUCTS)
novel.NOVEL_PRODUCTS = {c: pool[:1000] for c in cats}
novel.NOVEL_BRANDS = {c: pool[1000:1600] for c in cats}
novel.NOVEL_COLORS = pool[1600:1900]
novel.NOVEL_MATERIALS = {c: pool[1900:2200] for c in cats}
reqs = generate("train", n_train, seed=0)
copy = []
for r in generate("train", 6 * n_copy, seed=4242):
    new = novel.substitute(r, rng)
    if new is not None:
        new.id = f"copy-{len(copy):05d}"
        copy.append(new)
        if len(copy) == n_copy:
            break
assert len(copy) == n_copy, len(copy)
mix = reqs + copy
random.Random(3).shuffle(mix)
with open(out, "w") as fh:
    for r in mix:
        fh.write(json.dumps(r.model_dump(mode="json")) + "\n")
print(f"{len(reqs)} train + {len(copy)} copy prompts -> {out}; {len(words)} candidate words; e.g.",
      [c.query for c in copy[:4]])
