"""A point's replies scored against the task requests they answer: the guard that catches a deployment
that is fast because it answers wrongly, and the per-request scores the report's paired tests read."""

from __future__ import annotations

from typing import Sequence

from ..results import RequestRecord
from ..task.score import ItemScore, score_item
from .loadgen import ChatRequest


def score_replies(records: Sequence[RequestRecord], requests: Sequence[ChatRequest]) -> list[ItemScore | None]:
    """Each record's reply scored against the task request it answers, in record order; None for a
    failed request, a record without text, or one whose request has no task request behind it."""
    by_id = {r.id: r.source for r in requests if r.source is not None}
    return [score_item(by_id[rec.id], rec.text) if rec.ok and rec.text is not None and rec.id in by_id else None
            for rec in records]


def reply_quality(scores: Sequence[ItemScore | None]) -> tuple[float | None, float | None]:
    """(JSON-valid share, exact-match share) of a point's scored replies; (None, None) when none was scored.
    The guard that catches a deployment that is fast because it answers wrongly."""
    scored = [s for s in scores if s is not None]
    if not scored:
        return None, None
    with_gold = [s.exact for s in scored if s.exact is not None]
    return (sum(s.json_valid for s in scored) / len(scored),
            sum(with_gold) / len(with_gold) if with_gold else None)


def with_scores(records: Sequence[RequestRecord], scores: Sequence[ItemScore | None]) -> list[RequestRecord]:
    """Copies of ``records`` carrying their score's ``task`` and ``exact`` (kept in the results so that the
    report's paired tests never re-derive gold); an unscored record is returned as it is."""
    return [rec if s is None else rec.model_copy(update={"task": s.task, "exact": s.exact})
            for rec, s in zip(records, scores, strict=True)]
