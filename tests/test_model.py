"""The served model is what we think it is: conversion keeps the GGUF's function,
merging keeps the adapter's function, training resumes where it stopped."""

from pathlib import Path

import pytest
import torch
from conftest import make_lora

from cartspec.model.convert import ModelNotFound, bundled_gguf, convert_gguf
from cartspec.model.lora import LoraConfig, merge_adapter, train_lora
from cartspec.model.registry import resolve_model
from cartspec.task.generator import generate


def _logits(model, tok, text):
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0].float()


@pytest.mark.slow
def test_converted_model_matches_gguf_loaded_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_gguf()
    out = convert_gguf(gguf, out=tmp_path / "base")
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert "quantization_config" not in (out / "config.json").read_text()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    conv = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    text = "<|im_start|>user\nred trail running shoes under $120, size 10, no nike<|im_end|>\n<|im_start|>assistant\n"
    a, b = _logits(ref, tok, text), _logits(conv, tok, text)
    # bf16 storage rounds weights; the function must not change.
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert cos.min() > 0.999
    # cached: a second call does not convert again
    mtime = (out / "model.safetensors").stat().st_mtime
    assert convert_gguf(gguf, out=out) == out and (out / "model.safetensors").stat().st_mtime == mtime


def test_missing_model_errors_say_what_to_do(tmp_path):
    with pytest.raises(ModelNotFound, match="not found"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_adapter_directory_is_merged_onto_the_base(tmp_path, monkeypatch):
    """`--model runs/lora/v3` (a build-model --adapter-out, trained on the converted SmolLM2, possibly on
    another machine) serves base + that adapter."""
    from cartspec.model import registry

    merged = []
    monkeypatch.setattr(registry, "merged_commerce", lambda adapter: merged.append(adapter) or tmp_path / "m")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(
        '{"base_model_name_or_path": "/elsewhere/.cache/cartspec/models/base-b179c9523d0e"}')
    assert registry.resolve_model(str(tmp_path / "adapter")) == tmp_path / "m"
    assert merged == [tmp_path / "adapter"]
    with pytest.raises(ModelNotFound, match="GGUF file not found"):
        convert_gguf(tmp_path / "x.gguf", out=tmp_path / "o")



def test_merged_model_equals_base_plus_adapter(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    peft_model = make_lora(tiny_llama_dir, tmp_path / "adapter")
    merged_dir = merge_adapter(tiny_llama_dir, tmp_path / "adapter", tmp_path / "merged", dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(merged_dir)
    a = _logits(peft_model, tok, "blue hoodie size m")
    b = _logits(merged, tok, "blue hoodie size m")
    c = _logits(base, tok, "blue hoodie size m")
    assert torch.allclose(a, b, atol=1e-4)
    assert not torch.allclose(a, c, atol=1e-3)  # the adapter really changed the function


def test_lora_training_resumes_where_it_stopped(tiny_llama_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    data = generate("train", 24)
    cfg = LoraConfig(r=4, alpha=8, batch_size=4, save_every=2, warmup_steps=1, lr=1e-3)
    full = train_lora(tiny_llama_dir, data, tmp_path / "full", cfg, progress=False)

    calls = {"n": 0}
    real_step = torch.optim.AdamW.step

    def crashing_step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", crashing_step)
    with pytest.raises(KeyboardInterrupt):
        train_lora(tiny_llama_dir, data, tmp_path / "resumed", cfg, progress=False)
    assert (tmp_path / "resumed" / "checkpoint" / "state.json").exists()
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    resumed = train_lora(tiny_llama_dir, data, tmp_path / "resumed", cfg, progress=False)

    import json

    log = json.loads((resumed / "training_log.json").read_text())["log"]
    assert [e["step"] for e in log] == list(range(1, 7))  # no step lost, none redone
    a = load_file(full / "adapter_model.safetensors")
    b = load_file(resumed / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    assert {v.dtype for v in a.values()} == {torch.bfloat16}  # shipped at half the bytes
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def test_adapter_cache_key_is_its_weights_not_its_notes(tmp_path):
    from cartspec.model.registry import adapter_digest

    (tmp_path / "adapter_config.json").write_text('{"r": 16}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"weights")
    key = adapter_digest(tmp_path)
    (tmp_path / "PROVENANCE.md").write_text("notes")
    assert adapter_digest(tmp_path) == key
    (tmp_path / "adapter_model.safetensors").write_bytes(b"other weights")
    assert adapter_digest(tmp_path) != key


def test_neftune_noise_is_scaled_and_only_in_training():
    from cartspec.model.lora import add_neftune

    emb = torch.nn.Embedding(50, 16)
    ids = torch.randint(0, 50, (2, 9))
    clean = emb(ids)
    handle = add_neftune(emb, alpha=5.0)
    emb.train()
    noise = emb(ids) - clean
    bound = 5.0 / (9 * 16) ** 0.5
    assert noise.abs().max() <= bound + 1e-6 and noise.abs().max() > bound / 2
    assert not torch.equal(emb(ids), emb(ids))  # fresh noise every forward
    emb.eval()
    assert torch.equal(emb(ids), clean)  # serving and evaluation see clean embeddings
    handle.remove()


def test_direction_probe_runs_on_a_model_directory(tiny_llama_dir):
    """scripts/direction_probe.py (README, "The model") keeps working as the model code changes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts" / "direction_probe.py"
    run = subprocess.run([sys.executable, str(script), "--model", str(tiny_llama_dir), "--split", "dev",
                          "--limit", "40"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert len(out["pairs"]) == 6
    assert all(0 <= p[k] <= 1 for p in out["pairs"] for k in ("p_min_floor", "p_min_ceiling"))
    seen = out["first_price_key"]
    assert seen["floor"]["n"] > 0 and seen["ceiling"]["n"] > 0  # dev has both directions in 40 requests
    assert all(0 <= v["right"] <= 1 for v in seen.values())


def test_lora_training_reports_progress_in_a_log_file(tiny_llama_dir, tmp_path, capsys):
    """A build sent to a log file (nohup, CI) gets a line per checkpoint; rich draws no bar there."""
    cfg = LoraConfig(r=4, alpha=8, batch_size=4, save_every=2, warmup_steps=1, lr=1e-3)
    train_lora(tiny_llama_dir, generate("train", 24), tmp_path / "a", cfg, progress=True)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("LoRA step")]
    assert [ln.split()[2] for ln in lines] == ["2/6", "4/6", "6/6"]
    assert "tok/s" in lines[0] and "min left" in lines[0]
    train_lora(tiny_llama_dir, generate("train", 24), tmp_path / "b", cfg, progress=False)
    assert "LoRA step" not in capsys.readouterr().out
