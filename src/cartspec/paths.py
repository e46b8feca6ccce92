"""Where cartspec keeps what it builds.

``CARTSPEC_HOME`` (default ``~/.cache/cartspec``) holds converted and merged
models, data splits and feature shards, keyed by content hash. Small artefacts
that the main job needs (the LoRA adapter, draft heads) ship inside the package
under ``cartspec/assets`` with their provenance beside them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

PACKAGE_DIR = Path(__file__).resolve().parent
ASSETS = PACKAGE_DIR / "assets"


def home() -> Path:
    path = Path(os.environ.get("CARTSPEC_HOME", Path.home() / ".cache" / "cartspec")).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    return _sub("models")


def data_dir() -> Path:
    return _sub("data")


def _sub(name: str) -> Path:
    p = home() / name
    p.mkdir(parents=True, exist_ok=True)
    return p


def file_digest(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def dir_digest(path: Path, only: Iterable[str] | None = None) -> str:
    """Hash of a directory's files (names and contents), for cache keys; ``only``: just these files."""
    h = hashlib.sha256()
    files = [Path(path) / n for n in only] if only is not None else (p for p in Path(path).rglob("*") if p.is_file())
    for f in sorted(files):
        h.update(str(f.relative_to(path)).encode())
        h.update(file_digest(f).encode())
    return h.hexdigest()


def config_digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
