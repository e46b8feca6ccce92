"""The request files every command reads (JSONL), in one reader: ``read_requests``.

A line is either

* a cartspec request: ``{"query": str, "history": [..]?, "task": "search"|"support"?,
  "gold": {..}?, "system": str?}`` plus optional ``id`` and ``meta``. ``history``
  is a list of chat turns ``{"role", "content"}`` that came before ``query``;
  without ``system`` the task's own system prompt is used; or
* an OpenAI chat line: ``{"messages": [{"role", "content"}, ...]}`` (plus
  optional ``id``, ``task``, ``gold``, ``meta``), as chat logs and fine-tuning
  sets hold them. A leading ``system``/``developer`` message becomes the
  request's system prompt (none: no system prompt at all, the messages are sent
  as they are); the last user message is the query, the turns before it its
  history; a final assistant message (the logged reply) is kept in
  ``meta["reference"]``, not sent. ``content`` may be a string or a list of
  ``{"type": "text", "text"}`` parts.

Without gold only validity is scored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer

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
    system: str | None = Field(None, max_length=MAX_QUERY_CHARS * 4,
                               description="system prompt; None: the task's own, empty: none")

    @model_serializer(mode="wrap")
    def _drop_default_system(self, handler):
        out = handler(self)  # without a system of its own a request dumps as it did before the field existed
        if isinstance(out, dict) and out.get("system") is None:
            out.pop("system", None)
        return out

    @field_validator("query")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("query must not be blank")
        return v


class DataFileError(ValueError):
    """A request file that cannot be read; says which line and why."""


class ChatLineError(ValueError):
    pass


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        parts = [p.get("text", "") for p in content if p.get("type", "text") == "text"]
        if len(parts) != len(content):
            raise ChatLineError(f"{where}: only text content parts are supported")
        return "".join(parts)
    raise ChatLineError(f"{where}: content must be a string or a list of text parts")


def request_from_chat(obj: dict[str, Any]) -> Request:
    """An OpenAI chat line (``{"messages": [...]}``) as a request (see the module docstring)."""
    extra = set(obj) - {"messages", "id", "task", "gold", "meta"}
    if extra:
        raise ChatLineError(f"unexpected keys beside messages: {sorted(extra)}")
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ChatLineError("messages: a non-empty list of {role, content}")
    turns = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatLineError(f"messages.{i}: each message needs a role and content")
        turns.append((m["role"], _text(m.get("content"), f"messages.{i}.content")))
    system = ""
    if turns[0][0] in ("system", "developer"):
        system = turns.pop(0)[1]
    meta = dict(obj.get("meta") or {})
    if turns and turns[-1][0] == "assistant":
        meta["reference"] = turns.pop()[1]
    for i, (role, _) in enumerate(turns):
        if role not in ("user", "assistant"):
            raise ChatLineError(f"messages: role {role!r} is not supported (system first, then user/assistant)")
    if not turns or turns[-1][0] != "user":
        raise ChatLineError("messages: the conversation must end with a user message (then optionally the reply)")
    history = [{"role": r, "content": c} for r, c in turns[:-1]]
    if len(history) > MAX_HISTORY_TURNS:
        meta["history_dropped"] = len(history) - MAX_HISTORY_TURNS
        history = history[-MAX_HISTORY_TURNS:]
    fields = {k: obj[k] for k in ("id", "task", "gold") if obj.get(k) is not None}
    return Request.model_validate({"query": turns[-1][1], "history": history, "system": system, "meta": meta,
                                   **fields})


def parse_request_line(line: str) -> Request:
    """One line of a request file, either format."""
    obj = json.loads(line)
    if isinstance(obj, dict) and "messages" in obj:
        return request_from_chat(obj)
    return Request.model_validate(obj)


def read_requests(path: str | Path) -> list[Request]:
    """A JSONL file of cartspec request lines and/or OpenAI chat lines (``{"messages": [...]}``)."""
    path = Path(path)
    if not path.exists():
        raise DataFileError(f"request file not found: {path}")
    out: list[Request] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(parse_request_line(line))
            except json.JSONDecodeError as exc:
                raise DataFileError(f"{path}:{lineno}: not JSON: {exc.msg}") from None
            except ChatLineError as exc:
                raise DataFileError(f"{path}:{lineno}: {exc}") from None
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
