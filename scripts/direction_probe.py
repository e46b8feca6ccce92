"""Does the commerce model read the price direction from the request, or from its prior?

At the token that decides a price field ("price" + "_" -> "min" | "max") the model must find the
words beside the amount. This prints, for a model (HF transformers, float32, teacher-forced):

* p("min") after '{"intent": "search", "keywords": "x", "price_' for minimal pairs of requests
  that differ only in the direction phrase: a model that reads the cue gives the floors (over, more
  than, at least) a high p("min") and the ceilings a low one; a prior-following model gives them all
  the same;
* on a split, the share of requests with a price whose *first* price key (`_min` for a floor or a
  range, `_max` for a ceiling) the model ranks above the other, for floors and ceilings apart.

    .venv/bin/python scripts/direction_probe.py --model commerce --split dev
    .venv/bin/python scripts/direction_probe.py --model runs/lora/v7 --split test
"""

from __future__ import annotations

import argparse
import json

PAIRS = [("shoes over 50 dollars", "shoes under 50 dollars"),
         ("action camera, more than 40 cdn", "action camera, less than 40 cdn"),
         ("find boxing gloves a minimum of 60 Euros", "find boxing gloves a maximum of 60 Euros"),
         ("red sneakers by nike rated over 4 stars, more than 50 dollars",
          "red sneakers by nike rated over 4 stars, less than 50 dollars"),
         ("desk lamp 30 pounds or more", "desk lamp 30 pounds or less"),  # held-out phrasings
         ("yoga mat >$25", "yoga mat <$25")]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cartspec.model.lora import encode
    from cartspec.model.registry import resolve_model
    from cartspec.task.data import Request
    from cartspec.task.generator import DEFAULT_SIZES, generate
    from cartspec.task.prompts import render

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="commerce", help="commerce | base | model or adapter directory")
    ap.add_argument("--split", default="dev", choices=["train", "dev", "test"])
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t_min, t_max = tok.convert_tokens_to_ids("min"), tok.convert_tokens_to_ids("max")

    def p_min(query: str) -> float:
        text = render(tok, Request(query=query, task="search")) + '{"intent": "search", "keywords": "x", "price_'
        ids = tok(text, add_special_tokens=False).input_ids
        with torch.no_grad():
            probs = model(input_ids=torch.tensor([ids])).logits[0, -1].softmax(-1)
        return round(probs[t_min].item(), 3)

    pairs = [{"floor": a, "ceiling": b, "p_min_floor": p_min(a), "p_min_ceiling": p_min(b)} for a, b in PAIRS]
    right = {"floor": [], "ceiling": []}
    reqs = generate(args.split, DEFAULT_SIZES[args.split])[: args.limit]
    for req in reqs:
        if req.task != "search" or not ({"price_min", "price_max"} & set(req.gold or {})):
            continue
        ids, labels = encode(tok, req, 512)
        toks = tok.convert_ids_to_tokens([t if t >= 0 else tok.pad_token_id for t in labels])
        at = next(i for i in range(2, len(toks)) if labels[i] >= 0 and toks[i] in ("min", "max")
                  and toks[i - 1] == "_" and toks[i - 2] == "price")
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[:at]])).logits[0, -1]
        floor = toks[at] == "min"
        ok = logits[t_min] > logits[t_max] if floor else logits[t_max] > logits[t_min]
        right["floor" if floor else "ceiling"].append(bool(ok))
    print(json.dumps({"model": str(path), "pairs": pairs, "split": args.split,
                      "first_price_key": {k: {"n": len(v), "right": round(sum(v) / max(1, len(v)), 3)}
                                          for k, v in right.items()}}, indent=1))


if __name__ == "__main__":
    main()
