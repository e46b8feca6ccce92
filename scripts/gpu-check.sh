#!/usr/bin/env bash
# The bundled pipeline end to end on one GPU, printing its figures (target: <= 10 minutes):
# LoRA fine-tune of the commerce adapter, its accuracy, a domain head for it, its acceptance, study --preset quick.
# Needs a CUDA GPU and the `cuda` extra (pip install -e '.[cuda]'); refuses without one.
# Usage: scripts/gpu-check.sh [OUT_DIR]   (default runs/gpu-check)
set -euo pipefail
OUT=${1:-runs/gpu-check}
PY=${PYTHON:-python}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi finds none): this script only runs on a CUDA machine." >&2
  echo "gpu-check: on CPU, follow docs/your-own-model.md (the tiny-model walkthrough) instead." >&2
  exit 3
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: a GPU is present but this torch cannot use it (a CPU build?): install the cuda extra." >&2
  exit 3
fi
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
t0=$(date +%s)
step() { echo "== $* ($(( $(date +%s) - t0 )) s)"; }
step "LoRA fine-tune (GPU)"
cartspec build-model --retrain --adapter-out "$OUT/lora" --epochs 2
step "accuracy of the fine-tuned model"
cartspec eval-model --model "$OUT/lora" --data test --out "$OUT/eval.json"
step "domain head for it (regeneration with vLLM, capture and training on the GPU)"
cartspec draft train --kind domain --target "$OUT/lora" --out "$OUT/head" --prompts 1200 --device cuda
step "acceptance in vLLM"
cartspec draft acceptance --head "$OUT/head" --target "$OUT/lora" --data test --limit 200 --out "$OUT/acceptance.json"
step "study --preset quick"
cartspec study --preset quick --model "$OUT/lora" --deployments "baseline,eagle3:$OUT/head:3" --out "$OUT/study"
step "done"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
e = json.loads((out / "eval.json").read_text()); a = json.loads((out / "acceptance.json").read_text())
print(f"eval: field_accuracy {e.get('field_accuracy')} exact_match {e.get('exact_match')}")
print(f"acceptance (γ=3, vLLM): tau {a['tau']:.3f} rate {a['acceptance_rate']:.3f}")
print(f"study report: {out / 'study'}")
PYEOF
