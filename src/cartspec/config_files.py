"""Typed configs kept in files: one loader/saver for YAML, TOML and JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, model_serializer

from .private_files import write_private

M = TypeVar("M", bound=BaseModel)


def omit_when_none(*names: str):
    """A pydantic serializer, set as a class attribute, that leaves ``names`` out of the dump where they are
    None: a field added later, or set only sometimes, is written (and hashed) as before it existed."""

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        out = handler(self)
        if isinstance(out, dict):
            for name in names:
                if out.get(name) is None:
                    out.pop(name, None)
        return out

    return _omit


class FileModel(BaseModel):
    """A pydantic model that round-trips through ``.yaml``/``.yml``, ``.toml`` or ``.json``."""

    @classmethod
    def load(cls: type[M], path: str | Path) -> M:
        path = Path(path)
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
        return cls.model_validate(data)

    def save(self, path: str | Path) -> Path:
        """Write this model to ``path`` (YAML or JSON by suffix), owner-only: a config may name keys' variables,
        prompts or traffic."""
        path = Path(path)
        data = self.model_dump(mode="json")
        if path.suffix in (".yaml", ".yml"):
            import yaml

            write_private(path, yaml.safe_dump(data, sort_keys=False))
        else:
            write_private(path, json.dumps(data, indent=2))
        return path
