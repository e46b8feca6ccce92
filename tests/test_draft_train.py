"""Training-time test on the tiny model's own greedy outputs: it learns, and a
run interrupted and resumed ends exactly where an uninterrupted run ends."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from cartspec.draft.train import TrainConfig, select_draft_vocab, train_head


def tiny_greedy_records(model_dir, n=16, new_tokens=20, seed=0):
    """The tiny model answers commerce prompts greedily (HF generate; fast at this size)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cartspec.task.generator import generate
    from cartspec.task.prompts import render

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for r in generate("train", n, seed):
        ids = tok(render(tok, r), add_special_tokens=False).input_ids
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=tok.pad_token_id)
        out.append({"prompt_ids": ids, "output_ids": g[0, len(ids):].tolist()})
    return out


@pytest.fixture(scope="module")
def tiny_features(tiny_llama_dir, tmp_path_factory):
    from cartspec.draft.features import FeatureSet, aux_layer_ids_for, extract

    recs = tiny_greedy_records(tiny_llama_dir)
    d = tmp_path_factory.mktemp("feat")
    return FeatureSet.load(extract(tiny_llama_dir, recs, d, aux_layer_ids_for(tiny_llama_dir), shard_size=8))


def cfg(**kw):
    base = dict(ttt_steps=3, lr=3e-3, warmup_steps=5, batch_tokens=512, draft_vocab_size=256, save_every=1000,
                seed=0, threads=2)
    base.update(kw)
    return TrainConfig(**base)


def test_select_draft_vocab():
    ids = select_draft_vocab([5, 5, 5, 9, 9, 3], size=4, vocab_size=100, extra_tokens=[50, 50, 7], must=[2])
    assert ids.tolist() == [2, 3, 5, 9]  # must first, then by frequency; sorted by id
    ids = select_draft_vocab(Counter({5: 3}), size=6, vocab_size=100, extra_tokens=[50, 50, 7], must=[2])
    assert ids.tolist() == [0, 1, 2, 5, 7, 50]  # then prompt tokens by frequency, then the lowest ids


def test_training_learns_the_targets_continuations(tiny_features, tiny_llama_dir, tmp_path):
    head, summary = train_head(tiny_features, tiny_llama_dir, tmp_path, cfg(steps=60))
    hist = [r["acc"] for r in __import__("json").loads((tmp_path / "training_log.json").read_text())["history"]]
    first = sum(h[0] for h in hist[:3]) / 3
    last = sum(h[0] for h in hist[-5:]) / 5
    assert summary["steps"] == 60 and len(summary["acc_per_step_last20"]) == 3
    assert last > first + 0.2, (first, last)
    assert last > 0.5
    assert all(len(h) == 3 for h in hist)  # per-step accuracy logged for every unrolled step


def test_resume_matches_uninterrupted_run(tiny_features, tiny_llama_dir, tmp_path):
    full, _ = train_head(tiny_features, tiny_llama_dir, tmp_path / "a", cfg(steps=8, save_every=3))

    class Stop(Exception):
        pass

    def crash(step, total, rec):
        if step == 7:
            raise Stop

    with pytest.raises(Stop):
        train_head(tiny_features, tiny_llama_dir, tmp_path / "b", cfg(steps=8, save_every=3), on_step=crash)
    import json

    state = json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 6
    logs = []
    resumed, summary = train_head(tiny_features, tiny_llama_dir, tmp_path / "b", cfg(steps=8, save_every=3),
                                  log=logs.append)
    assert any("resuming from step 6" in m for m in logs)
    assert summary["steps"] == 8
    for (k, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)

    # other settings: the checkpoint is not reused
    logs.clear()
    train_head(tiny_features, tiny_llama_dir, tmp_path / "b", cfg(steps=2, save_every=3, lr=1e-4), log=logs.append)
    assert any("starting over" in m for m in logs)


def test_the_head_trains_without_bf16_autocast_where_bf16_would_be_emulated(tiny_features, tiny_llama_dir,
                                                                            tmp_path, monkeypatch):
    """On an AVX2-only CPU bf16 autocast is emulated (over ten times slower per step): the trainer computes in
    float32 there, and its log says so; where bf16 is native it autocasts."""
    from cartspec.draft import train as train_mod

    calls = []
    real_autocast = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: calls.append(k.get("dtype")) or real_autocast(*a, **k))
    monkeypatch.setattr(train_mod, "compute_dtype", lambda device: torch.float32)
    _, summary = train_head(tiny_features, tiny_llama_dir, tmp_path / "f32", cfg(steps=2))
    assert summary["compute_dtype"] == "float32" and calls == []
    monkeypatch.setattr(train_mod, "compute_dtype", lambda device: torch.bfloat16)
    _, summary = train_head(tiny_features, tiny_llama_dir, tmp_path / "bf16", cfg(steps=2))
    assert summary["compute_dtype"] == "bfloat16" and calls == [torch.bfloat16]
