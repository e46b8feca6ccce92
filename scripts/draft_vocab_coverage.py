"""Which reply tokens can a head never draft? The share, per token class, of the tokens in a `draft acceptance`
run's replies that lie outside the head's draft vocabulary (its d2t map).

    .venv/bin/python scripts/draft_vocab_coverage.py --head domain --acceptance FILE.json --data test|novel|FILE.jsonl

FILE.json: the output of `cartspec draft acceptance ... --out FILE.json` (its replies' token ids); --data: the
request set it was run on (the same --data and the run's own --limit are used)."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from cartspec.draft.acceptance import load_data
from cartspec.draft.classes import request_text, token_classes
from cartspec.model.registry import resolve_head, resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="domain", help="generic | domain | PATH")
    ap.add_argument("--acceptance", required=True, help="a `draft acceptance --out` JSON")
    ap.add_argument("--data", default="test")
    ap.add_argument("--target", default="commerce")
    args = ap.parse_args()
    d2t = load_file(str(resolve_head(args.head) / "model.safetensors"))["d2t"]
    draftable = set((d2t + torch.arange(len(d2t))).tolist())
    tok = AutoTokenizer.from_pretrained(str(resolve_model(args.target)))
    acc = json.load(open(args.acceptance))
    reqs = {r.id: r for r in load_data(args.data, acc["n"])}
    total, outside = Counter(), Counter()
    for rep in acc["replies"]:
        ids = rep["token_ids"]
        for t, c in zip(ids, token_classes(tok, ids, request_text(reqs[rep["id"]]))):
            total[c] += 1
            outside[c] += t not in draftable
    print(f"draft vocabulary {len(d2t)} tokens; reply tokens outside it, per class:")
    for c in total:
        print(f"  {c:22s} {outside[c]:5d} / {total[c]:5d} = {outside[c] / total[c]:.1%}")


if __name__ == "__main__":
    main()
