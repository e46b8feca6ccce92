"""The commerce task's output types: search parameters and support replies.

Both serialise to *canonical* JSON: only fields that carry information, in the
schema's field order, lists sorted. The model is trained to emit exactly that,
so gold, model output and agreement checks all compare like with like, and the
reply is as short as the task allows (fewer tokens = less latency).
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Intent(str, Enum):
    search = "search"
    refine = "refine"
    compare = "compare"
    support = "support"


class Category(str, Enum):
    shoes = "shoes"
    clothing = "clothing"
    electronics = "electronics"
    home = "home"
    beauty = "beauty"
    sports = "sports"
    toys = "toys"
    bags = "bags"
    jewelry = "jewelry"
    grocery = "grocery"


class Audience(str, Enum):
    men = "men"
    women = "women"
    unisex = "unisex"
    boys = "boys"
    girls = "girls"
    kids = "kids"
    baby = "baby"


class Currency(str, Enum):
    USD = "USD"
    EUR = "EUR"
    GBP = "GBP"
    CAD = "CAD"
    JPY = "JPY"


class Sort(str, Enum):
    relevance = "relevance"
    price_asc = "price_asc"
    price_desc = "price_desc"
    rating = "rating"
    newest = "newest"
    popularity = "popularity"


class Delivery(str, Enum):
    free_shipping = "free_shipping"
    same_day = "same_day"
    next_day = "next_day"
    two_day = "two_day"
    pickup = "pickup"


class SearchParams(BaseModel):
    """Parameters a product-search backend takes."""

    model_config = ConfigDict(extra="forbid", use_enum_values=True)

    intent: Literal["search", "refine", "compare"] = "search"
    keywords: str | None = Field(None, description="product type, e.g. 'trail running shoes'")
    category: Category | None = None
    brands_include: list[str] = Field(default_factory=list)
    brands_exclude: list[str] = Field(default_factory=list)
    colors: list[str] = Field(default_factory=list)
    size: str | None = None
    material: str | None = None
    audience: Audience | None = Field(None, description="gender or age group")
    price_min: float | None = Field(None, ge=0)
    price_max: float | None = Field(None, ge=0)
    currency: Currency | None = None
    min_rating: float | None = Field(None, ge=0, le=5)
    sort: Sort | None = None
    delivery: Delivery | None = None
    in_stock: bool | None = None

    @field_validator("brands_include", "brands_exclude", "colors")
    @classmethod
    def _lower_sorted(cls, v: list[str]) -> list[str]:
        return sorted({s.strip().lower() for s in v if s and s.strip()})

    @field_validator("keywords", "size", "material")
    @classmethod
    def _strip(cls, v: str | None) -> str | None:
        if v is None:
            return None
        v = v.strip().lower()
        return v or None


class SupportTopic(str, Enum):
    refund_window = "refund_window"
    return_shipping = "return_shipping"
    order_status = "order_status"
    payment_methods = "payment_methods"
    shipping_times = "shipping_times"
    international = "international"
    cancel_order = "cancel_order"
    warranty = "warranty"


class SupportReply(BaseModel):
    """A support answer: the topic it was routed to and the reply text."""

    model_config = ConfigDict(extra="forbid", use_enum_values=True)

    intent: Literal["support"] = "support"
    topic: SupportTopic
    order_id: str | None = None
    reply: str

    @field_validator("reply")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("reply must not be empty")
        return v


TaskName = Literal["search", "support"]
SCHEMAS: dict[str, type[BaseModel]] = {"search": SearchParams, "support": SupportReply}


def canonical_dict(obj: BaseModel) -> dict[str, Any]:
    """Fields that carry information, in schema order (the training target)."""
    out: dict[str, Any] = {}
    for name, field in type(obj).model_fields.items():
        value = getattr(obj, name)
        if isinstance(value, Enum):
            value = value.value
        if name == "intent":
            out[name] = value
            continue
        if value is None or value == [] or (field.default is not None and value == field.default):
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        out[name] = value
    return out


def canonical_json(obj: BaseModel) -> str:
    return json.dumps(canonical_dict(obj), ensure_ascii=False, separators=(", ", ": "))


def json_schema(task: TaskName) -> dict[str, Any]:
    """JSON schema handed to vLLM's structured outputs."""
    return SCHEMAS[task].model_json_schema()


def union(*schemas: dict[str, Any]) -> dict[str, Any]:
    """One schema any of ``schemas`` satisfies (``anyOf``), with their ``$defs`` moved to the top so
    that the references resolve (a deployment serving several reply types drafts for all of them)."""
    if len(schemas) == 1:
        return schemas[0]
    defs: dict[str, Any] = {}
    parts = []
    for s in schemas:
        s = dict(s)
        for name, d in s.pop("$defs", {}).items():
            if name in defs and defs[name] != d:
                raise ValueError(f"schemas define $defs/{name} differently; give one schema")
            defs[name] = d
        parts.append(s)
    out: dict[str, Any] = {"anyOf": parts}
    if defs:
        out["$defs"] = defs
    return out


def reply_schema() -> dict[str, Any]:
    """Every reply the commerce task asks for (search parameters or a support reply), as one JSON schema: the
    schema drafter's default for requests that send none."""
    return union(json_schema("search"), json_schema("support"))
