#!/bin/bash
# usage: own-model-demo.sh ARCH [DIR]  -- train a head for runs/issue15/ARCH on the prompts, then measure it (vLLM, simulator)
set -euo pipefail
A=$1; R=${2:-runs/issue15}
C=".venv/bin/python -m cartspec.cli"
$C draft train --target $R/$A --prompts $R/prompts.jsonl --out $R/head-$A --max-tokens 48 --sampled 0 \
   --steps 250 --draft-vocab 2048 --batch-tokens 2048 --ttt-steps 3 --lr 2e-3 --enforce-eager --device cpu
$C draft acceptance --head $R/head-$A --target $R/$A --data $R/prompts.jsonl --limit 64 --gamma 3 \
   --max-tokens 48 --enforce-eager --out $R/acc-$A-vllm.json
$C draft acceptance --head $R/head-$A --target $R/$A --data $R/prompts.jsonl --limit 64 --gamma 3 \
   --max-tokens 48 --enforce-eager --simulate --out $R/acc-$A-sim.json
