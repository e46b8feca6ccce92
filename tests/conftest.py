"""Shared fixtures: a tiny random Llama with SmolLM2's tokenizer (vLLM CPU loads it)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)


def smollm_tokenizer():
    """SmolLM2's tokenizer, from the bundled GGUF (also used by scripts/tiny-targets.py)."""
    from transformers import AutoTokenizer

    from cartspec.model.convert import bundled_gguf

    g = bundled_gguf()
    return AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer (with chat template), saved once per session."""
    out = tmp_path_factory.mktemp("tokenizer")
    smollm_tokenizer().save_pretrained(out)
    return out


def make_tiny_llama(out: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      **{**TINY, **overrides})
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """4 layers, hidden 128, 2 heads of head_dim 64 (vLLM CPU rejects head_dim 16)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)


@pytest.fixture(autouse=True, scope="session")
def _isolated_home(tmp_path_factory):
    """Tests never write into the user's cache, except for its models (slow to rebuild).

    ``CARTSPEC_HOME`` is a fresh directory for the session (subprocesses inherit it), so tune/, draft/ and
    data/ land there; its ``models/`` is a link to the user's, where the converted base and merged models
    are cached by content hash (shared safely, rebuilt in minutes otherwise). A test that needs an empty
    home of its own still sets CARTSPEC_HOME itself (monkeypatch), for that test only.
    """
    user = Path(os.environ.get("CARTSPEC_HOME", Path.home() / ".cache" / "cartspec")).expanduser()
    (user / "models").mkdir(parents=True, exist_ok=True)
    home = tmp_path_factory.mktemp("cartspec-home")
    (home / "models").symlink_to(user / "models", target_is_directory=True)
    before = os.environ.get("CARTSPEC_HOME")
    os.environ["CARTSPEC_HOME"] = str(home)
    yield home
    if before is None:
        os.environ.pop("CARTSPEC_HOME", None)
    else:
        os.environ["CARTSPEC_HOME"] = before


# --- tiny random targets of each supported architecture (built in the test, never downloaded) ---------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
ARCHITECTURES = ("llama", "llama3", "qwen3")


def make_tiny_target(arch: str, out: Path, tokenizer_dir: Path, seed: int = 0, dtype: str = "bfloat16",
                     **overrides) -> Path:
    """``llama`` (plain RoPE), ``llama3`` (Llama 3.1-style ``rope_scaling``, theta 500000, scaled below
    position 64 already) or ``qwen3`` (q/k norms, untied lm_head, theta 1e6), with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, rms_norm_eps=1e-5, **TINY)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **{**common, **overrides}))
    elif arch == "llama3":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, rope_theta=500000.0,
                                             rope_scaling=dict(LLAMA3_ROPE), **{**common, **overrides}))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=False, rope_theta=1e6,
                                             **{**common, **overrides}))
    else:
        raise ValueError(arch)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_lora(base_dir: Path, out: Path, seed: int = 0):
    """A LoRA adapter (r=4 on q/v/down projections) on ``base_dir`` with random non-zero B matrices, saved to
    ``out``; returns the peft model in eval mode."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                             task_type="CAUSAL_LM"))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; make the adapter do something
            torch.nn.init.normal_(p, std=0.05)
    model.save_pretrained(out)
    return model.eval()


def make_random_head(target_dir: Path, out: Path, seed: int = 0, target: dict | None = None) -> Path:
    """A randomly initialised EAGLE-3 head for ``target_dir`` (256-token draft vocabulary), exported for vLLM;
    ``target``: the record pinning it to its target (``{"digest": ..., "name": ...}``), as `draft train` writes."""
    import json

    import torch

    from cartspec.draft.export import export_head
    from cartspec.draft.head import Eagle3Head, HeadConfig

    cfg = HeadConfig.for_target(json.loads((Path(target_dir) / "config.json").read_text()), draft_vocab_size=256)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    head.set_vocab(torch.arange(256))
    return export_head(head, out, target=target)


# A random model's next-token distribution is near uniform (max probability ~6e-5 over 49k tokens), which
# leaves the head's soft cross-entropy nothing to learn; scaling the final norm makes the target confident
# (max probability ~0.95), as a fine-tuned model is.
NORM_SCALE = 40.0


def confident_target(arch: str, out: Path, tokenizer_dir: Path) -> Path:
    """A tiny random ``arch`` target whose final norm is scaled by ``NORM_SCALE``, saved in bf16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    raw = make_tiny_target(arch, out.with_name(out.name + "-raw"), tokenizer_dir, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(raw, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(NORM_SCALE)
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(raw).save_pretrained(out)
    return out


# --- a browser for the report's test ---------------------------------------------------------------

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str | None:
    return next((shutil.which(n) for n in BROWSERS if shutil.which(n)), None)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _install_chromium() -> str:
    """Debian's ``chromium`` with the ordinary package client, where this session can (root, apt-get): ""
    when it went in, else why not. Serialised by a lock file: parallel sessions on one host share dpkg's."""
    import subprocess

    if not shutil.which("apt-get"):
        return "no apt-get on this machine"
    if os.geteuid() != 0:
        return "not root: install it with `sudo apt-get install -y chromium`"
    cmd = "apt-get update -qq && apt-get install -y -qq chromium"
    if shutil.which("flock"):
        cmd = f"flock /tmp/cartspec-apt.lock sh -c '{cmd}'"
    try:
        done = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=900,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    except subprocess.TimeoutExpired:
        return f"`{cmd}` ran past 15 minutes"
    if done.returncode != 0:
        return f"`{cmd}` failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-400:]}"
    return ""


@pytest.fixture(scope="session")
def chromium_or_why() -> tuple[str | None, str]:
    """(the headless browser's path, "") or (None, why there is none). A machine without one gets Debian's
    ``chromium`` installed once per session where it can, so the report's browser test runs in CI instead of
    being skipped there."""
    path = find_chromium()
    if path:
        return path, ""
    why = _install_chromium()
    path = find_chromium()
    return (path, "") if path else (None, why or "apt-get installed chromium, but no chromium is on PATH")
