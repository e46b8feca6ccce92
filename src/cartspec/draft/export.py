"""Write / read a head directory that vLLM serves with ``{"method": "eagle3", "model": DIR}``.

``config.json`` is a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``
(vLLM maps it to ``Eagle3LlamaForCausalLM``), one hidden layer, the target's
sizes and vocab, ``draft_vocab_size``, ``target_hidden_size``,
``norm_before_residual`` written out explicitly, and
``eagle_config.eagle_aux_hidden_state_layer_ids`` (vLLM's model runner reads
them to decide which target layers to capture). ``model.safetensors`` holds the
weights under the checkpoint names (bf16; ``d2t`` int64, ``t2d`` bool).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .head import Eagle3Head, HeadConfig, target_rope

WEIGHTS = "model.safetensors"


def vllm_config(cfg: HeadConfig, dtype: str = "bfloat16", target: dict[str, Any] | None = None) -> dict[str, Any]:
    # the target's RoPE (with its scaling): vLLM's drafter builds its rotary embedding from this config
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default", **(cfg.rope_scaling or {})}
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        **({"rope_scaling": dict(cfg.rope_scaling)} if cfg.rope_scaling else {}),
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True},
        "torch_dtype": dtype,
        "dtype": dtype,
        # what cartspec needs to rebuild the head exactly (vLLM ignores it)
        "cartspec": {"head_config": cfg.to_dict(), **({"target": target} if target else {})},
    }
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        out["eos_token_id"] = cfg.eos_token_id
    return out


def export_head(head: Eagle3Head, out_dir: Path, dtype: torch.dtype = torch.bfloat16,
                metadata: dict[str, Any] | None = None, target: dict[str, Any] | None = None) -> Path:
    """``target``: the model the head was trained for (``digest``: ``registry.target_digest``, ``name``);
    serve/study/acceptance refuse the head on another model."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in head.state_dict().items():
        v = v.detach().cpu()
        if v.is_floating_point():
            v = v.to(dtype)
        tensors[k] = v.contiguous()
    tmp = out_dir / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", **{k: json.dumps(v) for k, v in (metadata or {}).items()}})
    tmp.replace(out_dir / WEIGHTS)
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    (out_dir / "config.json").write_text(json.dumps(vllm_config(head.cfg, name, target), indent=2) + "\n")
    return out_dir


def load_head(head_dir: Path, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Rebuild a head from an exported directory (ours, or any with the same layout)."""
    from safetensors.torch import load_file

    head_dir = Path(head_dir)
    conf = json.loads((head_dir / "config.json").read_text())
    if "cartspec" in conf:
        cfg = HeadConfig.from_dict(conf["cartspec"]["head_config"])
    else:
        eagle = conf.get("eagle_config") or {}
        theta, scaling = target_rope(conf)
        cfg = HeadConfig(
            hidden_size=conf["hidden_size"], intermediate_size=conf["intermediate_size"],
            num_attention_heads=conf["num_attention_heads"],
            num_key_value_heads=conf.get("num_key_value_heads") or conf["num_attention_heads"],
            head_dim=conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"],
            vocab_size=conf["vocab_size"], draft_vocab_size=conf.get("draft_vocab_size") or conf["vocab_size"],
            target_hidden_size=conf.get("target_hidden_size") or conf["hidden_size"],
            aux_layer_ids=eagle.get("eagle_aux_hidden_state_layer_ids") or [],
            rms_norm_eps=conf.get("rms_norm_eps", 1e-5),
            rope_theta=theta, rope_scaling=scaling,
            norm_before_residual=bool(conf.get("norm_before_residual", False)))
    head = Eagle3Head(cfg)
    state = load_file(str(head_dir / WEIGHTS))
    missing, unexpected = head.load_state_dict({k: v for k, v in state.items()}, strict=False)
    if unexpected:
        raise ValueError(f"{head_dir}: unexpected weights {sorted(unexpected)[:5]}")
    if any(m not in ("t2d", "d2t") for m in missing):
        raise ValueError(f"{head_dir}: missing weights {sorted(missing)[:5]}")
    if "t2d" in missing and "d2t" not in missing:
        head.t2d.zero_()
        head.t2d[head.draft_ids] = True
    return head.to(dtype)


def head_size_bytes(head_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(head_dir).glob("*.safetensors"))
