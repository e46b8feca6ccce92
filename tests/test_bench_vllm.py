"""A tiny study against real vLLM on CPU: baseline, n-gram speculation, and a head that does not exist."""

from __future__ import annotations

import json

import httpx
import pytest

from cartspec.bench.metrics import SpecCounters
from cartspec.bench.sweep import SweepPlan, parse_deployment, run_sweep
from cartspec.report.build import build_report
from cartspec.serving.server import VllmServer

pytestmark = pytest.mark.vllm


def test_tiny_sweep_on_vllm(tiny_llama_dir, tmp_path, monkeypatch):
    model = str(tiny_llama_dir)
    deps = [parse_deployment(d, model) for d in ("baseline", "ngram:3", f"eagle3:{tmp_path / 'missing-head'}:3")]
    deps = [d.model_copy(update={"enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 8,
                                 "start_timeout_s": 300}) for d in deps]
    plan = SweepPlan(name="tiny", deployments=deps, concurrencies=[1, 4], temperatures=[0.0], n_requests=4,
                     warmup=1, max_tokens=16)
    out = tmp_path / "run"
    # What each deployment's vLLM exported on /metrics, read just before the study stops it.
    counters: dict[str, SpecCounters] = {}
    stop = VllmServer.stop

    def scrape_then_stop(server, *args, **kwargs):
        # stop() also runs when a start fails, before the server listens: a scrape that cannot connect must
        # neither hide why the start failed nor leave the server running (a missing scrape fails below).
        try:
            if server.alive():
                text = httpx.get(server.url + "/metrics", timeout=60).text
                counters[server.spec.label] = SpecCounters.from_text(text)
        except httpx.HTTPError:
            pass
        finally:
            stop(server, *args, **kwargs)

    monkeypatch.setattr(VllmServer, "stop", scrape_then_stop)
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
    # n-gram speculation is really on, whether or not the random model's replies gave n-gram lookup a match:
    # vLLM registers its spec-decode counters and attaches per-request spec-decode metrics only when it was
    # started with a speculative config. A --speculative-config dropped on the way fails both checks.
    assert counters["ngram-g3"].present and not counters["baseline"].present
    for c in (1, 4):
        ngram, base = by[("ngram-g3", c)], by[("baseline", c)]
        assert all(rec.request_spec_metrics is not None and "num_spec_steps" in rec.request_spec_metrics
                   for rec in ngram.records)
        assert all(rec.request_spec_metrics is None for rec in base.records) and base.acceptance is None
        # the point's acceptance: read whenever some reply drafted (from /metrics, else the replies), and sane
        if any(rec.request_spec_metrics["num_spec_steps"] for rec in ngram.records):
            assert ngram.acceptance is not None and ngram.acceptance.source in ("metrics", "responses")
        if ngram.acceptance is not None:
            assert ngram.acceptance.steps > 0 and 0 <= ngram.acceptance.accepted <= ngram.acceptance.drafted
            assert ngram.acceptance.drafted <= 3 * ngram.acceptance.steps  # γ = 3
    failed = [r for r in results if r.config.method == "eagle3"]
    assert len(failed) == 2 and all(r.status == "failed" and "missing-head" in r.reason for r in failed)
    rep = build_report(out)
    rows = json.loads(rep.summary.read_text())["points"]
    assert len(rows) == 6
    assert all(r["speedup_vs_baseline"] for r in rows if r["status"] == "ok")
