"""Names users type (``base``, ``commerce``, ``domain``...) -> directories on disk."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

from ..paths import ASSETS, config_digest, dir_digest, file_digest, home, models_dir
from .convert import ModelNotFound, convert_gguf
from .heads import head_target

BUNDLED_ADAPTER = ASSETS / "lora" / "commerce"
HEADS_DIR = ASSETS / "heads"
POINTERS_DIR = ASSETS / "pointers"
BUNDLED_POINTER = "commerce"  # the pointer trained for the bundled commerce model (``draft.pointer``)


def _check_hf_dir(path: Path, what: str) -> Path:
    shown = str(path) if len(str(path)) <= 200 else f"{str(path)[:120]}... ({len(str(path))} characters)"
    try:
        if not path.exists():
            raise ModelNotFound(f"{what} not found: {shown}")
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{shown} is not a Hugging Face model directory (no config.json)")
    except OSError as e:  # a name too long for the file system, a directory without access: not a model
        raise ModelNotFound(f"{what} {shown} cannot be read: {e.strerror or e}") from None
    return path


def resolve_model(name: str) -> Path:
    """``base`` (converted GGUF), ``commerce`` (base + bundled LoRA, merged), or a path: a model
    directory, or a LoRA adapter directory merged onto the base its ``adapter_config.json`` names
    (``base_model_name_or_path``: a local model directory; cartspec downloads nothing)."""
    if name == "base":
        return convert_gguf()
    if name == "commerce":
        return merged_commerce()
    path = Path(name).expanduser()
    try:
        adapter = (path / "adapter_config.json").exists() and not (path / "config.json").exists()
    except OSError:
        adapter = False  # _check_hf_dir says why the path cannot be read
    if adapter:
        return merged_adapter(path)
    return _check_hf_dir(path, "model directory")


_CONVERTED_BASE = re.compile(r"^base-[0-9a-f]{12}$")


def adapter_base(adapter: Path) -> Path | None:
    """The local base directory an adapter names, or None when it names the bundled SmolLM2 as converted
    from its GGUF (a ``base-<digest>`` directory, possibly converted on another machine)."""
    conf = json.loads((adapter / "adapter_config.json").read_text())
    named = conf.get("base_model_name_or_path")
    if not named:
        raise ModelNotFound(f"{adapter}/adapter_config.json names no base model (base_model_name_or_path): "
                            "set it to the local directory of the model the adapter was trained on")
    base = Path(named).expanduser()
    if not base.is_absolute() and not base.exists():
        base = adapter / base  # relative to the adapter directory
    if (base / "config.json").exists():
        marker = base / "cartspec.json"
        if marker.exists() and json.loads(marker.read_text()).get("stage") == "convert":
            return None
        return base
    if _CONVERTED_BASE.match(Path(named).name):
        return None  # the bundled base, converted elsewhere: convert it here
    raise ModelNotFound(
        f"the adapter {adapter} was trained on {named!r}, which is not a local model directory "
        "(cartspec never downloads models): put the base model's Hugging Face directory on disk and set "
        "base_model_name_or_path in adapter_config.json to that directory")


def merged_adapter(adapter: Path) -> Path:
    """An adapter merged onto the base it names (the bundled SmolLM2: ``merged_commerce``), cached by the
    contents of both."""
    from .lora import merge_adapter

    adapter = Path(adapter)
    base = adapter_base(adapter)
    if base is None:
        return merged_commerce(adapter)
    base_id = target_digest(base)
    key = config_digest([adapter_digest(adapter), base_id])[:12]
    out = models_dir() / f"merged-{key}"
    marker = out / "cartspec.json"
    if not marker.exists():
        merge_adapter(base, adapter, out, dtype=None)
        marker.write_text(json.dumps({"stage": "merge", "base": str(base), "adapter": str(adapter),
                                      "adapter_digest": adapter_digest(adapter)[:12], "base_digest": base_id},
                                     indent=2))
    return out


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


# --- which model a head was trained for -------------------------------------------------------

_IGNORED_CONFIG_KEYS = {"transformers_version", "_name_or_path", "use_cache", "torch_dtype", "dtype"}


def _content_digest(model_dir: Path) -> str:
    """Hash of the weights (every ``*.safetensors``) and the config (minus keys that do not change the
    function: the writer's transformers version, a path...), cached beside the user's cache by size and
    mtime, so an 8B target is hashed once."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{model_dir} holds no *.safetensors weights")
    stamp = config_digest([str(model_dir.resolve()), [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                                      for f in files + [model_dir / "config.json"]]])
    cache = home() / "model-digests.json"
    known = json.loads(cache.read_text()) if cache.exists() else {}
    if stamp not in known:
        conf = {k: v for k, v in json.loads((model_dir / "config.json").read_text()).items()
                if k not in _IGNORED_CONFIG_KEYS}
        known[stamp] = config_digest({"weights": [(f.name, file_digest(f)) for f in files], "config": conf})
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(cache)
    return known[stamp]


def _merge_base(m: dict[str, Any]) -> Path:
    """The base a merged model's marker names. A merge made under another ``CARTSPEC_HOME`` (a test session's,
    whose models/ links to the user's) names a path that is gone: the same converted base in this home's
    models/ is the one meant (cached models are named by content)."""
    base = Path(m["base"])
    if not (base / "config.json").exists() and (models_dir() / base.name / "config.json").exists():
        return models_dir() / base.name
    return base


def target_digest(model_dir: Path) -> str:
    """What a head records as "the model I was trained for" (16 hex digits).

    Models cartspec builds are named by what they are made of, so the digest is the same on every machine
    whatever the conversion or merge wrote bit for bit: the converted SmolLM2 by its GGUF's sha256, a
    merged model by its base's digest and its adapter's weights. Any other directory: its content."""
    model_dir = Path(model_dir)
    marker = model_dir / "cartspec.json"
    if marker.exists():
        m = json.loads(marker.read_text())
        if m.get("stage") == "convert" and m.get("source_sha256"):
            return config_digest({"gguf": m["source_sha256"], "dtype": m.get("dtype")})
        if m.get("stage") == "merge" and m.get("adapter_digest"):
            base = m.get("base_digest") or target_digest(_merge_base(m))
            return config_digest({"base": base, "adapter": m["adapter_digest"][:12]})
    return _content_digest(model_dir)


def model_lineage(model_dir: Path) -> list[str]:
    """The model's digest, then its base's (and so on): a head trained for a base also drafts for the
    fine-tunes cartspec merged onto it (the study's ``generic`` head on the commerce model)."""
    out = [target_digest(model_dir)]
    marker = Path(model_dir) / "cartspec.json"
    if marker.exists():
        m = json.loads(marker.read_text())
        if m.get("stage") == "merge" and m.get("base") and (_merge_base(m) / "config.json").exists():
            out += [d for d in model_lineage(_merge_base(m)) if d not in out]
        elif m.get("stage") == "merge" and m.get("base_digest"):
            out.append(m["base_digest"])
    return out


class HeadMismatch(ValueError):
    """A draft head trained for another model than the one served."""


def check_head(head_dir: Path, model_dir: Path, force: bool = False,
               warn: Callable[[str], None] | None = None, what: str = "draft head") -> str:
    """Refuse (``HeadMismatch``) a head trained for another target; with ``force``, warn loudly and go on.
    Returns "match", "base" (trained for this model's base), "unknown" (the head records no target)
    or "forced"."""
    rec = head_target(head_dir) or {}
    lineage = model_lineage(model_dir)
    if rec.get("digest") == lineage[0]:
        return "match"
    if rec.get("digest") in lineage[1:]:
        return "base"
    if not rec.get("digest"):
        if warn:
            warn(f"the head {head_dir} does not record which target it was trained for; "
                 f"cannot check that it fits {model_dir}")
        return "unknown"
    msg = (f"the {what} {head_dir} was trained for another target ({rec.get('name') or '?'}, digest "
           f"{rec['digest']}) than the served model {model_dir} (digest {lineage[0]})")
    if what == "draft head":
        msg += (": its drafts would rarely be accepted. Train a head for this model (`cartspec draft train "
                f"--target {model_dir} --prompts FILE.jsonl`), or pass --force to serve it anyway")
    else:
        msg += (f". Train one for this model (`cartspec draft pointer --target {model_dir} --out DIR`), or "
                "choose another hybrid rule (--rule text)")
    if not force:
        raise HeadMismatch(msg)
    if warn:
        warn("WARNING (--force): " + msg.split(". Train")[0])
    return "forced"


def matching_bundled_head(model_dir: Path) -> str | None:
    """``--head auto``: the bundled head trained for this model (``domain`` first), else one trained for
    its base, else None."""
    lineage = model_lineage(model_dir)
    found = {}
    for name in ("domain", "generic"):
        if (HEADS_DIR / name / "config.json").exists():
            d = (head_target(HEADS_DIR / name) or {}).get("digest")
            if d in lineage:
                found[name] = lineage.index(d)
    return min(found, key=lambda n: (found[n], n != "domain")) if found else None


def resolve_head(name: str) -> Path:
    """A head registry's current version (``NAME``, where ``$CARTSPEC_HOME/heads/NAME/versions/`` exists) or
    one of its versions (``NAME@v0002``); else ``domain`` / ``generic`` (bundled EAGLE-3 heads) or a path to a
    head directory."""
    from .heads import resolve_registered

    registered = resolve_registered(str(name))
    if registered is not None:
        return registered.path
    return resolve_plain_head(name)


def resolve_plain_head(name: str) -> Path:
    """``domain`` / ``generic`` (bundled EAGLE-3 heads) or a path to a head directory, never a registry."""
    if name in ("domain", "generic"):
        path = HEADS_DIR / name
        if not (path / "config.json").exists():
            raise ModelNotFound(f"no bundled {name!r} head at {path}: train it with `cartspec draft train --kind {name}`")
        return path
    return _check_hf_dir(Path(name).expanduser(), "draft head directory")


def resolve_pointer(name: str | None) -> Path:
    """The hybrid's pointer (``draft.pointer``): ``commerce`` (or nothing: the bundled one, trained for the
    bundled commerce model) or a directory ``cartspec draft pointer`` wrote."""
    path = POINTERS_DIR / BUNDLED_POINTER if name in (None, "", BUNDLED_POINTER) else Path(str(name)).expanduser()
    if not (path / "pointer.safetensors").is_file() or not (path / "config.json").is_file():
        raise ModelNotFound(f"no pointer (pointer.safetensors, config.json) at {path}: train one with "
                            "`cartspec draft pointer --target MODEL --out DIR`")
    return path


HEAD_POINTER = "pointer"  # a head directory's own pointer, trained with it (``draft refresh``): HEAD/pointer/


def head_pointer(head_dir: Path | str | None) -> Path | None:
    """The pointer kept in a head's directory (``HEAD_POINTER``), trained with that head as one version of the
    deployed drafter; None where the head has none (the bundled heads, a head from ``draft train``)."""
    if head_dir is None:
        return None
    path = Path(head_dir) / HEAD_POINTER
    return path if (path / "pointer.safetensors").is_file() and (path / "config.json").is_file() else None


def head_digest(head_dir: Path) -> str:
    """An EAGLE-3 head's digest (its config and weights; every file where it has no model.safetensors), as an
    export and a head version's provenance record it."""
    only = [n for n in ("config.json", "model.safetensors") if (Path(head_dir) / n).is_file()]
    return dir_digest(Path(head_dir), only=only if "model.safetensors" in only else None)


def pointer_digest(pointer_dir: Path) -> str:
    """A pointer's digest (its config and weights), as an export and a head version's provenance record it."""
    only = [n for n in ("config.json", "pointer.safetensors") if (Path(pointer_dir) / n).is_file()]
    return dir_digest(Path(pointer_dir), only=only)


def matching_bundled_pointer(model_dir: Path) -> str | None:
    """The bundled pointer's name where it was trained for this very model, else None."""
    path = POINTERS_DIR / BUNDLED_POINTER
    if not (path / "config.json").exists():
        return None
    return BUNDLED_POINTER if (head_target(path) or {}).get("digest") == target_digest(model_dir) else None


def check_spec_head(spec: Any, force: bool = False, warn: Callable[[str], None] | None = None) -> str | None:
    """``check_head`` for a deployment spec's EAGLE-3 head (None: no head to check, or a head or model
    that does not resolve, which starting the deployment reports)."""
    sp = getattr(spec, "speculative", None)
    if sp is None or not getattr(sp, "model", None) or sp.method in ("none", "ngram", "suffix", "draft_model"):
        return None
    try:
        model_dir, head_dir = resolve_model(spec.model), resolve_head(sp.model)
    except (ModelNotFound, FileNotFoundError):
        return None
    found = check_head(head_dir, model_dir, force=force, warn=warn)
    cfg = sp.hybrid_config(str(model_dir)) if sp.method == "hybrid" else None
    if cfg is not None and cfg.pointer:  # a rule that reads the pointer (its directory resolved)
        check_head(Path(cfg.pointer), model_dir, force=force, warn=warn, what="pointer")
    return found
