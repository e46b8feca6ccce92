"""A tiny study against real vLLM on CPU: baseline, n-gram speculation, and a head that does not exist."""

from __future__ import annotations

import json

import pytest

from cartspec.bench.sweep import SweepPlan, parse_deployment, run_sweep
from cartspec.report.build import build_report

pytestmark = pytest.mark.vllm


def test_tiny_sweep_on_vllm(tiny_llama_dir, tmp_path):
    model = str(tiny_llama_dir)
    deps = [parse_deployment(d, model) for d in ("baseline", "ngram:3", f"eagle3:{tmp_path / 'missing-head'}:3")]
    deps = [d.model_copy(update={"enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 8,
                                 "start_timeout_s": 300}) for d in deps]
    plan = SweepPlan(name="tiny", deployments=deps, concurrencies=[1, 4], temperatures=[0.0], n_requests=4,
                     warmup=1, max_tokens=16)
    out = tmp_path / "run"
    results = run_sweep(plan, out)
    by = {(r.config.deployment, r.config.concurrency): r for r in results}
    for label in ("baseline", "ngram-g3"):
        for c in (1, 4):
            r = by[(label, c)]
            assert r.status == "ok", r.reason
            assert r.n_requests == 4 and r.n_errors == 0
            assert r.output_tokens > 0 and r.ttft_p50 > 0 and r.e2el_p50 >= r.ttft_p50
            assert all(rec.usage_reported for rec in r.records)
            assert r.deployment.versions["vllm"].startswith("vllm")
    # n-gram speculation is on: vLLM exports its counters (drafts only when the prompt has a matching n-gram)
    ngram = by[("ngram-g3", 4)]
    assert ngram.spec is None or ngram.spec.drafts >= 0
    failed = [r for r in results if r.config.method == "eagle3"]
    assert len(failed) == 2 and all(r.status == "failed" and "missing-head" in r.reason for r in failed)
    rep = build_report(out)
    rows = json.loads(rep.summary.read_text())["points"]
    assert len(rows) == 6
    assert all(r["speedup_vs_baseline"] for r in rows if r["status"] == "ok")
