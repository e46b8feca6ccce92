"""Targets of each supported architecture: the head is sized from their config and rotates its queries and
keys exactly as vLLM's EAGLE-3 drafter does (its own ``get_rope`` on the config the head exports)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ARCHITECTURES, LLAMA3_ROPE, make_tiny_target

from cartspec.draft.export import export_head, load_head
from cartspec.draft.head import Eagle3Head, HeadConfig, apply_rope, rope_cos_sin


def _vllm_rope(head_cfg: dict, head_dim: int):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):  # a CustomOp needs one to be built
        return get_rope(head_dim, max_position=head_cfg["max_position_embeddings"], is_neox_style=True,
                    rope_parameters=head_cfg["rope_parameters"], dtype=torch.float32)


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE, {"rope_type": "linear", "factor": 4.0}],
                         ids=["default", "llama3", "linear"])
def test_head_rope_equals_vllm_drafter_rope(rope, tmp_path):
    """Positions up to 1000 cross the llama3 low/high frequency bands (original context 64)."""
    target = {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 64, "intermediate_size": 256, "vocab_size": 300, "max_position_embeddings": 2048,
              "rope_parameters": {"rope_theta": 500000.0, **(rope or {"rope_type": "default"})}}
    cfg = HeadConfig.for_target(target, draft_vocab_size=300)
    assert cfg.rope_scaling == (dict(rope) if rope else None)
    head = Eagle3Head(cfg)
    exported = json.loads((export_head(head, tmp_path / "h") / "config.json").read_text())
    vrope = _vllm_rope(exported, cfg.head_dim)
    torch.manual_seed(0)
    pos = torch.tensor([0, 1, 5, 63, 64, 200, 511, 1000])
    q = torch.randn(len(pos), cfg.num_attention_heads, cfg.head_dim)
    k = torch.randn(len(pos), cfg.num_key_value_heads, cfg.head_dim)
    vq, vk = vrope.forward_native(pos, q.flatten(1).clone(), k.flatten(1).clone())
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.allclose(apply_rope(q, cos, sin).flatten(1), vq, atol=1e-4)
    assert torch.allclose(apply_rope(k, cos, sin).flatten(1), vk, atol=1e-4)
    if rope:  # and it is not the plain rotation: the check above would catch a head ignoring the scaling
        cos0, sin0 = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
        assert not torch.allclose(apply_rope(q, cos0, sin0).flatten(1), vq, atol=1e-3)
    assert load_head(tmp_path / "h").cfg.rope_scaling == cfg.rope_scaling


def test_unsupported_rope_is_refused_clearly():
    with pytest.raises(ValueError, match="RoPE type 'yarn' is not supported"):
        Eagle3Head(HeadConfig(hidden_size=8, intermediate_size=8, num_attention_heads=1, num_key_value_heads=1,
                              head_dim=8, vocab_size=10, draft_vocab_size=10, target_hidden_size=8,
                              aux_layer_ids=[0], rope_scaling={"rope_type": "yarn", "factor": 4.0}))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_head_for_each_architecture(arch, tokenizer_dir, tmp_path):
    """Sized from the saved target config; features captured from the real HF model feed it."""
    from transformers import AutoModelForCausalLM

    from cartspec.draft.features import aux_layer_ids_for, capture
    from cartspec.draft.train import load_target_weights

    target = make_tiny_target(arch, tmp_path / arch, tokenizer_dir)
    conf = json.loads((target / "config.json").read_text())
    cfg = HeadConfig.for_target(conf, draft_vocab_size=512, aux_layer_ids=aux_layer_ids_for(target))
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if arch == "llama3" else None)
    assert cfg.rope_theta == {"llama": 10000.0, "llama3": 500000.0, "qwen3": 1e6}[arch]
    head = Eagle3Head(cfg)
    head.set_vocab(torch.arange(512))
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    ids = torch.randint(0, 1000, (1, 12))
    aux, final, arg = capture(model, ids, torch.ones_like(ids), cfg.aux_layer_ids)
    tw = load_target_weights(target)
    if arch == "qwen3":  # untied: the target's own lm_head, not the embedding
        assert not torch.equal(tw["lm_head"], tw["embed"])
    out = head.unroll(tw["embed"].float(), ids, aux.float(), torch.tensor([12]), torch.tensor([[0, 3]]), steps=3)
    assert [o["logits"].shape for o in out] == [torch.Size([1, 512])] * 3
