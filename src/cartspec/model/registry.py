"""Names users type (``base``, ``commerce``, ``domain``...) -> directories on disk."""

from __future__ import annotations

import json
from pathlib import Path

from ..paths import ASSETS, dir_digest, models_dir
from .convert import ModelNotFound, convert_gguf

BUNDLED_ADAPTER = ASSETS / "lora" / "commerce"
HEADS_DIR = ASSETS / "heads"


def _check_hf_dir(path: Path, what: str) -> Path:
    if not path.exists():
        raise ModelNotFound(f"{what} not found: {path}")
    if not (path / "config.json").exists():
        raise ModelNotFound(f"{path} is not a Hugging Face model directory (no config.json)")
    return path


def resolve_model(name: str) -> Path:
    """``base`` (converted GGUF), ``commerce`` (base + bundled LoRA, merged), or a path: a model
    directory, or a LoRA adapter directory (from ``build-model --adapter-out``), merged onto the base."""
    if name == "base":
        return convert_gguf()
    if name == "commerce":
        return merged_commerce()
    path = Path(name).expanduser()
    if (path / "adapter_config.json").exists() and not (path / "config.json").exists():
        return merged_commerce(path)
    return _check_hf_dir(path, "model directory")


def adapter_digest(adapter: Path) -> str:
    """Cache key of an adapter: its config and weights only (editing its PROVENANCE.md or training log
    does not make a new model)."""
    return dir_digest(adapter, only=("adapter_config.json", "adapter_model.safetensors"))


def merged_commerce(adapter: Path = BUNDLED_ADAPTER) -> Path:
    """The fine-tuned target: base + adapter merged, cached by both contents."""
    from .lora import merge_adapter

    if not (adapter / "adapter_config.json").exists():
        raise ModelNotFound(
            f"no LoRA adapter at {adapter}: build it with `cartspec build-model` "
            "(or pass a model directory with --model PATH)")
    base = convert_gguf()
    key = adapter_digest(adapter)[:12]
    out = models_dir() / f"commerce-{key}"
    marker = out / "cartspec.json"
    if not marker.exists():
        merge_adapter(base, adapter, out)
        marker.write_text(json.dumps({"stage": "merge", "base": str(base), "adapter": str(adapter),
                                      "adapter_digest": key}, indent=2))
    return out


def resolve_head(name: str) -> Path:
    """``domain`` / ``generic`` (bundled EAGLE-3 heads) or a path to a head directory."""
    if name in ("domain", "generic"):
        path = HEADS_DIR / name
        if not (path / "config.json").exists():
            raise ModelNotFound(f"no bundled {name!r} head at {path}: train it with `cartspec draft train --kind {name}`")
        return path
    return _check_hf_dir(Path(name).expanduser(), "draft head directory")
