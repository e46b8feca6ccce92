"""Integration: vLLM on CPU serves a head trained here and accepts its drafts.

The tiny model answers commerce prompts (vLLM offline, greedy), a head is
trained on its features for a few seconds, exported, and served with
``{"method": "eagle3"}``; every request reports per-step acceptance. The
offline simulator, fed the same greedy outputs, must agree with the engine: a
wrong layer-id convention or a wrong export would break that agreement.
"""

from __future__ import annotations

import json

import pytest


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_serves_our_head_and_accepts_its_tokens(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    from transformers import AutoTokenizer

    from cartspec.draft.acceptance import measure_simulated, measure_vllm
    from cartspec.draft.export import export_head
    from cartspec.draft.features import FeatureSet, Sampling, build_features
    from cartspec.draft.train import TrainConfig, train_head
    from cartspec.task.generator import generate
    from cartspec.task.prompts import render

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    train_reqs = generate("train", 48, 0)
    test_reqs = generate("test", 12, 0)
    # the same greedy answers the simulator will use: the test prompts are part of training
    # here on purpose (this checks loading and agreement, not generalisation)
    reqs = train_reqs + test_reqs
    prompts = [tok(render(tok, r), add_special_tokens=False).input_ids for r in reqs]
    fdir, records, shards = build_features(tiny_llama_dir, prompts, [Sampling(0.0, max_tokens=24)] * len(prompts),
                                           tag="it", enforce_eager=True)
    assert all(len(r["output_ids"]) > 0 for r in records)
    fs = FeatureSet.load(shards)
    head, summary = train_head(fs, tiny_llama_dir, tmp_path / "work",
                               TrainConfig(ttt_steps=3, steps=150, lr=3e-3, warmup_steps=10, batch_tokens=1024,
                                           draft_vocab_size=512, threads=2))
    assert summary["acc_per_step_last20"][0] > 0.5
    head_dir = export_head(head, tmp_path / "head")

    real = measure_vllm(str(tiny_llama_dir), "eagle3", 3, test_reqs, head=str(head_dir), concurrency=4,
                        max_tokens=24, log_dir=tmp_path / "logs", enforce_eager=True)
    (tmp_path / "real.json").write_text(json.dumps(real, indent=1))
    assert real["requests_without_step_metrics"] == 0
    assert real["verify_steps"] > 0 and real["draft_tokens"] > 0
    assert real["acceptance_rate"] > 0, real
    assert real["tau"] > 1.0
    # per-step arrays agree with the engine's own per-request totals
    assert real["accepted_tokens"] == real["engine_counts"]["num_accepted_draft_tokens"]
    assert real["verify_steps"] == real["engine_counts"]["num_spec_steps"]

    sim = measure_simulated(str(tiny_llama_dir), "eagle3", 3, test_reqs, head=str(head_dir), max_tokens=24,
                            enforce_eager=True)
    assert sim["tau"] > 1.0
    assert abs(sim["tau"] - real["tau"]) / real["tau"] < 0.15, (sim["tau"], real["tau"])
    # what `draft acceptance --out` writes: each measurement as an AcceptanceReport, its keys and values kept
    from cartspec.draft.acceptance import AcceptanceReport

    for res in (real, sim):
        path = AcceptanceReport.model_validate(res).save(tmp_path / f"{res['mode']}-report.json")
        assert json.loads(path.read_text()) == json.loads(json.dumps(res))
        assert AcceptanceReport.load(path).tau == res["tau"]
