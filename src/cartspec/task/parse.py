"""Robust reading of a model's reply: JSON with stray text, truncated JSON, wrong types.

``parse_reply`` finds the JSON object in a reply and repairs what it can;
``coerce`` turns it into the task's schema, fixing types a service can safely
fix ("$50" -> 50.0, "black" -> ["black"], "yes" -> true) and dropping what it
cannot. ``json_valid`` and ``schema_valid`` are judged on the reply as written,
before any repair, so the scorer never flatters the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from .schema import SCHEMAS

_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.IGNORECASE)


@dataclass
class Parsed:
    data: dict[str, Any] | None
    json_valid: bool
    repaired: bool = False
    error: str | None = None
    raw_json: str | None = None


def _balanced_object(text: str) -> tuple[str | None, bool]:
    """The first ``{...}`` in text; if it never closes, a repaired version."""
    start = text.find("{")
    if start < 0:
        return None, False
    depth, in_str, esc = 0, False, False
    stack: list[str] = []
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
            depth += 1
        elif ch in "}]":
            if stack:
                stack.pop()
            depth -= 1
            if depth == 0:
                return text[start:i + 1], False
    # Truncated: close the open string, drop a dangling key or comma, close brackets.
    frag = text[start:]
    if in_str:
        frag += '"'
    frag = re.sub(r',\s*"[^"]*"\s*:?\s*$', "", frag)  # dangling key
    frag = re.sub(r'[,:]\s*$', "", frag)
    return frag + "".join(reversed(stack)), True


def parse_reply(text: str) -> Parsed:
    stripped = text.strip()
    try:
        obj = json.loads(stripped)
        if isinstance(obj, dict):
            return Parsed(obj, json_valid=True, raw_json=stripped)
    except json.JSONDecodeError:
        pass
    candidate, truncated = _balanced_object(_FENCE.sub("", stripped))
    if candidate is None:
        return Parsed(None, json_valid=False, error="no JSON object in reply")
    for attempt in (candidate, re.sub(r",\s*([}\]])", r"\1", candidate)):  # trailing commas
        try:
            obj = json.loads(attempt)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return Parsed(obj, json_valid=False, repaired=True, raw_json=attempt,
                          error="truncated JSON" if truncated else "JSON with stray text")
    return Parsed(None, json_valid=False, error="unparsable JSON")


_NUM = re.compile(r"-?\d+(?:[.,]\d+)?")
_TRUE = {"true", "yes", "y", "1", "in stock", "instock"}
_FALSE = {"false", "no", "n", "0"}


def _to_number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        s = v.lower().replace(",", "")
        m = _NUM.search(s)
        if not m:
            return None
        x = float(m.group())
        if re.search(r"\d\s*k\b", s):
            x *= 1000
        return x
    return None


def _fix_value(name: str, info, v: Any) -> Any:
    ann = str(info.annotation)
    if "list[str]" in ann:
        if isinstance(v, str):
            return [s.strip() for s in re.split(r",| and ", v) if s.strip()]
        if isinstance(v, list):
            return [str(x) for x in v if x is not None]
        return None
    if "float" in ann:
        return _to_number(v)
    if "bool" in ann:
        if isinstance(v, str):
            low = v.strip().lower()
            return True if low in _TRUE else False if low in _FALSE else None
        return v if isinstance(v, bool) else None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v) if "str" in ann else v
    if isinstance(v, str):
        return v.strip().lower() if name not in ("reply", "order_id") else v.strip()
    return v


def coerce(task: str, data: dict[str, Any] | None) -> BaseModel | None:
    """Best-effort typed reply: fix types, drop unknown keys and values the schema rejects."""
    if data is None:
        return None
    schema = SCHEMAS[task]
    try:
        return schema.model_validate(data)
    except ValidationError:
        pass
    fields = schema.model_fields
    clean: dict[str, Any] = {}
    for k, v in data.items():
        k = str(k).strip().lower()
        if k not in fields or v is None:
            continue
        fixed = _fix_value(k, fields[k], v)
        if fixed is None:
            continue
        try:  # keep a field only if it validates on its own
            schema.model_validate({**_required_defaults(task), k: fixed})
            clean[k] = fixed
        except ValidationError:
            continue
    try:
        return schema.model_validate(clean)
    except ValidationError:
        return None


def _required_defaults(task: str) -> dict[str, Any]:
    return {"topic": "refund_window", "reply": "x"} if task == "support" else {}


def schema_valid(task: str, parsed: Parsed) -> bool:
    """The reply as written (not repaired) validates against the schema, with JSON types."""
    if not parsed.json_valid or parsed.raw_json is None:
        return False
    try:
        SCHEMAS[task].model_validate_json(parsed.raw_json, strict=True)
        return True
    except ValidationError:
        return False


@dataclass
class Reading:
    """What one reply amounts to, for scoring and for the agent service."""

    parsed: Parsed
    value: BaseModel | None
    schema_valid: bool
    notes: list[str] = field(default_factory=list)


def read_reply(task: str, text: str) -> Reading:
    parsed = parse_reply(text)
    return Reading(parsed=parsed, value=coerce(task, parsed.data), schema_valid=schema_valid(task, parsed))
