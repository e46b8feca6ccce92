#!/bin/bash
# Tests that must fail against deliberately broken implementations: each mutation is applied to a
# clean worktree of HEAD, the test is run there (real vLLM), and it must FAIL.
# Usage: scripts/mutation-check.sh [OUT_DIR]   (about 5 minutes on 2 CPU cores; writes one log per mutation)
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"; ROOT=$PWD
W=/tmp/cartspec-mut; OUT=${1:-runs/mutations}; mkdir -p $OUT
rm -rf $W; git worktree prune; git worktree add -q --detach $W HEAD
run() {  # name file sed-expr test
  local name=$1 file=$2 expr=$3 test=$4
  (cd $W && git checkout -q -- . && sed -i "$expr" "$file" && git diff --stat | tail -1) > $OUT/$name.log
  if (cd $W && git diff --quiet); then echo "$name: the mutation changed nothing" | tee -a $OUT/$name.log; return; fi
  (cd $W && git diff) >> $OUT/$name.log
  (cd $W && PYTHONPATH=$W/src timeout 900 $ROOT/.venv/bin/python -m pytest -x -q -p no:cacheprovider "$test") >> $OUT/$name.log 2>&1
  rc=$?; echo "$name: pytest exit $rc ($( [ $rc -ne 0 ] && echo 'FAILED as it must' || echo 'PASSED: the test does not see this break'))" | tee -a $OUT/$name.log
}
# 1. the study never counts drafted tokens from /metrics (the old test: "ngram.spec is None or drafts >= 0")
run metrics-drafted src/cartspec/bench/metrics.py 's/c.draft_tokens += value/c.draft_tokens += 0/' tests/test_bench_vllm.py
# 2. the agent never counts an upstream's drafts (the old test: "drafts >= 0")
run agent-drafts src/cartspec/agent/metrics.py '/def observe_spec/{n;n;s/^\(\s*\)if stats is None:/\1if True:/}' tests/test_agent_vllm.py
# 3. the agent's requests lose their JSON schema (the old test passed on 200 or 502 alike)
run agent-no-schema src/cartspec/serving/client.py 's/body\["response_format"\] = /_dropped = /' tests/test_agent_vllm.py
cd $ROOT && git worktree remove --force $W
