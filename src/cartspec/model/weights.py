"""A target model's input embedding, output head and final norm, read from its safetensors."""

from __future__ import annotations

from pathlib import Path

import torch

def load_target_weights(target_dir: Path) -> dict[str, torch.Tensor]:
    """The target's embedding, lm_head (tied -> the embedding) and final norm."""
    from safetensors import safe_open

    want = {"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head", "model.norm.weight": "norm"}
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k in want:
                    out[want[k]] = fh.get_tensor(k)
    if "embed" not in out:
        raise ValueError(f"no model.embed_tokens.weight in {target_dir}")
    out.setdefault("lm_head", out["embed"])
    return out
