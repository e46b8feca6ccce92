"""Export: the directory has the config keys and weight names vLLM's
Eagle3LlamaForCausalLM reads, and loads back into the same head."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from cartspec.draft.export import export_head, head_size_bytes, load_head
from cartspec.draft.head import Eagle3Head, HeadConfig


def make_head(nbr=True) -> Eagle3Head:
    cfg = HeadConfig(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                     vocab_size=300, draft_vocab_size=40, target_hidden_size=64, aux_layer_ids=[2, 15, 27],
                     rms_norm_eps=1e-5, rope_theta=100000.0, norm_before_residual=nbr, bos_token_id=1,
                     eos_token_id=2, target_num_hidden_layers=30)
    torch.manual_seed(0)
    h = Eagle3Head(cfg)
    for p in h.parameters():
        torch.nn.init.normal_(p, std=0.1)
    h.set_vocab(torch.sort(torch.randperm(300)[:40]).values)
    return h


def test_round_trip_and_vllm_layout(tmp_path):
    head = make_head(nbr=False)
    out = export_head(head, tmp_path / "head")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["num_hidden_layers"] == 1 and conf["hidden_size"] == 64
    assert conf["draft_vocab_size"] == 40 and conf["vocab_size"] == 300 and conf["target_hidden_size"] == 64
    assert conf["norm_before_residual"] is False  # written explicitly
    assert conf["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "use_aux_hidden_state": True}
    assert conf["rope_parameters"]["rope_theta"] == 100000.0

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {k: f.get_tensor(k).dtype for k in names}
    assert dtypes["d2t"] == torch.int64 and dtypes["t2d"] == torch.bool
    assert all(dt == torch.bfloat16 for k, dt in dtypes.items() if k not in ("d2t", "t2d"))
    assert not any("embed_tokens" in n for n in names)  # vLLM shares the target's embeddings

    # the names vLLM's loader maps onto Eagle3LlamaForCausalLM's parameters
    from vllm.model_executor.models.llama_eagle3 import LlamaModel

    mapped = set()
    for n in names:
        if "t2d" in n:
            continue  # vLLM skips t2d
        if "d2t" in n:
            mapped.add(n.replace("d2t", "draft_id_to_target_id"))
            continue
        n = n if "lm_head" in n else "model." + n
        mapped.add(LlamaModel.hf_to_vllm_mapper.map_name(n))
    assert mapped == {
        "draft_id_to_target_id", "lm_head.weight", "model.fc.weight", "model.norm.weight",
        "model.layers.0.hidden_norm.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight"}

    back = load_head(out)
    assert back.cfg == head.cfg
    for (k, a), (k2, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert k == k2
        if a.is_floating_point():
            torch.testing.assert_close(b, a.to(torch.bfloat16).float(), rtol=0, atol=0)
        else:
            assert torch.equal(a, b), k
    assert head_size_bytes(out) == (out / "model.safetensors").stat().st_size


def test_load_head_without_cartspec_metadata(tmp_path):
    """A head dir written by other tools (no `cartspec` block) loads from the vLLM keys alone."""
    head = make_head(nbr=True)
    out = export_head(head, tmp_path / "h")
    conf = json.loads((out / "config.json").read_text())
    del conf["cartspec"]
    (out / "config.json").write_text(json.dumps(conf))
    back = load_head(out)
    assert back.cfg.norm_before_residual is True and back.cfg.aux_layer_ids == [2, 15, 27]
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)
