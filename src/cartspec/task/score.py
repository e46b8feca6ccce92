"""Scoring replies against gold: validity, per-field accuracy, exact match.

``field_accuracy`` is micro-averaged over the fields that gold *or* the
prediction sets (an empty field on both sides is not counted), so a model
cannot score by leaving everything empty, and an invented field counts against
it. Strings compare case-insensitively, lists as sets, numbers within 1e-6.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from .data import Request
from .parse import read_reply
from .schema import SCHEMAS, canonical_dict


def _norm(v: Any) -> Any:
    if isinstance(v, str):
        return " ".join(v.lower().split())
    if isinstance(v, list):
        return tuple(sorted(_norm(x) for x in v))
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return round(float(v), 6)
    return v


def field_diff(gold: dict[str, Any], pred: dict[str, Any] | None) -> dict[str, bool]:
    """Field -> correct?, over the union of fields set in gold or prediction."""
    pred = pred or {}
    return {k: (k in gold and k in pred and _norm(gold[k]) == _norm(pred[k]))
            for k in sorted(set(gold) | set(pred))}


@dataclass
class ItemScore:
    id: str | None
    task: str
    json_valid: bool
    schema_valid: bool
    exact: bool | None
    fields: dict[str, bool] = field(default_factory=dict)
    pred: dict[str, Any] | None = None
    error: str | None = None
    gold: dict[str, Any] | None = None

    def wrong(self) -> dict[str, dict[str, Any]]:
        """Each wrong field with what gold says and what the reply said (None: not set)."""
        return {k: {"gold": (self.gold or {}).get(k), "got": (self.pred or {}).get(k)}
                for k, ok in self.fields.items() if not ok}


def score_item(req: Request, reply: str) -> ItemScore:
    reading = read_reply(req.task, reply)
    pred = canonical_dict(reading.value) if reading.value is not None else None
    fields: dict[str, bool] = {}
    exact = None
    if req.gold is not None:
        gold = canonical_dict(SCHEMAS[req.task].model_validate(req.gold))
        fields = field_diff(gold, pred)
        exact = pred is not None and all(fields.values())
    return ItemScore(id=req.id, task=req.task, json_valid=reading.parsed.json_valid,
                     schema_valid=reading.schema_valid, exact=exact, fields=fields, pred=pred,
                     error=reading.parsed.error, gold=gold if req.gold is not None else None)


def aggregate(items: list[ItemScore], requests: list[Request] | None = None) -> dict[str, Any]:
    n = len(items)
    out: dict[str, Any] = {"n": n}
    if n == 0:
        return out
    out["json_valid"] = sum(i.json_valid for i in items) / n
    out["schema_valid"] = sum(i.schema_valid for i in items) / n
    gold_items = [i for i in items if i.exact is not None]
    if gold_items:
        out["exact_match"] = sum(bool(i.exact) for i in gold_items) / len(gold_items)
        total = sum(len(i.fields) for i in gold_items)
        right = sum(sum(i.fields.values()) for i in gold_items)
        out["field_accuracy"] = right / total if total else 1.0
        per: dict[str, list[bool]] = defaultdict(list)
        for i in gold_items:
            for k, ok in i.fields.items():
                per[k].append(ok)
        out["per_field"] = {k: {"n": len(v), "accuracy": sum(v) / len(v)} for k, v in sorted(per.items())}
    if requests:
        groups: dict[str, list[ItemScore]] = defaultdict(list)
        for req, item in zip(requests, items):
            groups[req.meta.get("kind", req.task)].append(item)
        if len(groups) > 1:
            out["by_kind"] = {k: _headline(v) for k, v in sorted(groups.items())}
        # generated requests say what in them training never showed (task/generator.py: unseen)
        novel: dict[str, list[ItemScore]] = defaultdict(list)
        for req, item in zip(requests, items):
            if "unseen" in req.meta:
                novel[req.meta["unseen"]].append(item)
        if novel:
            out["by_unseen"] = {k: _headline(novel[k]) for k in ("none", "values", "phrasings", "both") if k in novel}
    return out


def _headline(items: list[ItemScore]) -> dict[str, Any]:
    """A group's scores without the per-field breakdown."""
    return {k: v for k, v in aggregate(items).items() if k != "per_field"}


def as_dict(model: BaseModel | None) -> dict[str, Any] | None:
    return canonical_dict(model) if model is not None else None
