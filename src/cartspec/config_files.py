"""Typed configs kept in files: one loader/saver for YAML, TOML and JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


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
        path = Path(path)
        data = self.model_dump(mode="json")
        if path.suffix in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(data, sort_keys=False))
        else:
            path.write_text(json.dumps(data, indent=2))
        return path
