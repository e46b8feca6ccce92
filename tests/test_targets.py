"""Targets users bring: a LoRA adapter merged onto the base it names, and the digest a head records."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_lora, make_tiny_target

from cartspec.model.convert import ModelNotFound



def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_adapter_is_merged_onto_the_local_base_it_names(tokenizer_dir, tmp_path):
    """A LoRA on a tiny Qwen3 (not SmolLM2): `--model ADAPTER` serves that base + the adapter, the merged
    logits equal peft's unmerged forward, and the merge is cached by content."""
    from transformers import AutoModelForCausalLM

    from cartspec.model.registry import resolve_model, target_digest

    base = make_tiny_target("qwen3", tmp_path / "qwen3-base", tokenizer_dir, dtype="float32")
    peft_model = make_lora(base, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == str(base)
    merged = resolve_model(str(tmp_path / "adapter"))
    assert merged.name.startswith("merged-")
    conf = json.loads((merged / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3ForCausalLM"] and conf["hidden_size"] == 128
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 400, 2000, 31, 77, 9000, 12]])
    a, b = _logits(peft_model, ids), _logits(model, ids)
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    with torch.no_grad(), peft_model.disable_adapter():
        assert not torch.allclose(a, _logits(peft_model, ids), atol=1e-3)  # the adapter changed the function
    mtime = (merged / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(tmp_path / "adapter")) == merged
    assert (merged / "model.safetensors").stat().st_mtime_ns == mtime  # cached
    # the merged model's identity: its base and adapter, not its path
    assert target_digest(merged) != target_digest(base)


def test_adapter_whose_base_is_not_local_is_refused_clearly(tmp_path):
    from cartspec.model.registry import resolve_model

    (tmp_path / "adapter").mkdir()
    cfg = tmp_path / "adapter" / "adapter_config.json"
    cfg.write_text(json.dumps({"base_model_name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}))
    with pytest.raises(ModelNotFound, match="not a local model directory.*base_model_name_or_path"):
        resolve_model(str(tmp_path / "adapter"))
    cfg.write_text("{}")
    with pytest.raises(ModelNotFound, match="names no base model"):
        resolve_model(str(tmp_path / "adapter"))


def test_target_digest_ignores_paths_and_writer_versions(tiny_llama_dir, tmp_path):
    import shutil

    from cartspec.model.registry import target_digest

    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    conf = json.loads((copy / "config.json").read_text())
    conf["transformers_version"] = "0.0.1"
    (copy / "config.json").write_text(json.dumps(conf))
    assert target_digest(copy) == target_digest(tiny_llama_dir)
    conf["num_hidden_layers"] = 3
    (copy / "config.json").write_text(json.dumps(conf))
    assert target_digest(copy) != target_digest(tiny_llama_dir)
