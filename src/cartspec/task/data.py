"""The one request file format used in and out everywhere (JSONL).

Each line: ``{"query": str, "history": [..]?, "task": "search"|"support"?,
"gold": {..}?}`` plus optional ``id`` and ``meta``. Without gold only validity
is scored. ``history`` is a list of chat turns ``{"role", "content"}`` that came
before ``query``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_QUERY_CHARS = 2000
MAX_HISTORY_TURNS = 16


class Turn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str = Field(max_length=MAX_QUERY_CHARS * 2)


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=MAX_QUERY_CHARS)
    history: list[Turn] = Field(default_factory=list, max_length=MAX_HISTORY_TURNS)
    task: Literal["search", "support"] = "search"
    gold: dict[str, Any] | None = None
    id: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)

    @field_validator("query")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("query must not be blank")
        return v


class DataFileError(ValueError):
    """A request file that cannot be read; says which line and why."""


def read_requests(path: str | Path) -> list[Request]:
    path = Path(path)
    if not path.exists():
        raise DataFileError(f"request file not found: {path}")
    out: list[Request] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(Request.model_validate_json(line))
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first.get("loc", ())) or "line"
                raise DataFileError(f"{path}:{lineno}: {where}: {first['msg']}") from None
    if not out:
        raise DataFileError(f"{path} holds no requests")
    return out


def write_requests(path: str | Path, requests: Iterable[Request]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for r in requests:
            fh.write(r.model_dump_json(exclude_none=True, exclude_defaults=False) + "\n")
    tmp.replace(path)
    return path


def append_jsonl(path: str | Path, record: dict[str, Any] | BaseModel) -> None:
    """Append one record and flush, so a crash loses at most the line being written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = record.model_dump_json() if isinstance(record, BaseModel) else json.dumps(record)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read records, skipping a torn last line left by a crash."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
