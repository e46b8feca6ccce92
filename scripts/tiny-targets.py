"""Tiny random targets (llama, llama3 rope scaling, qwen3; final norm scaled x40 so that their next token is
confident, as a fine-tuned model's is, and a head has something to learn) and a prompt file (chat and request lines) under
runs/issue15/, for docs/your-own-model.md. Run from the repository root: python scripts/tiny-targets.py"""
import json, random, sys
from pathlib import Path
sys.path.insert(0, "tests")
from conftest import confident_target, smollm_tokenizer

root = Path("runs/issue15")
tokdir = root / "tokenizer"
smollm_tokenizer().save_pretrained(tokdir)
for arch in ("llama", "llama3", "qwen3"):
    if not (root / arch / "config.json").exists():
        confident_target(arch, root / arch, tokdir)  # final norm x40: something for a head to learn
rng = random.Random(0)
words = "red blue shoes jacket size price under over cheap leather running wool hat return order refund ship".split()
with open(root / "prompts.jsonl", "w") as fh:
    for i in range(240):
        q = " ".join(rng.choice(words) for _ in range(rng.randrange(4, 12)))
        if i % 2:
            fh.write(json.dumps({"messages": [{"role": "system", "content": "You help shoppers."},
                                              {"role": "user", "content": q}]}) + "\n")
        else:
            fh.write(json.dumps({"query": q}) + "\n")
