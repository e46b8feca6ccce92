"""vLLM's Prometheus ``/metrics``: speculative-decoding counters read around a point.

The counters are cumulative over the server's life, so a point's acceptance is
the difference of two scrapes: one after the warm-up, one after the last
measured request. Metric names as vLLM 0.32 exports them (``_total`` suffix on
counters); series of several engines or models are summed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import httpx

from ..results import AcceptanceStats

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` for every sample line; comments and ``_created`` series skipped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name.endswith("_created"):
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        out.append((name, dict(_LABEL.findall(labels)), v))
    return out


@dataclass
class SpecCounters:
    """One scrape of the speculative-decoding counters (``present`` false when the server has none)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: dict[int, float] = field(default_factory=dict)
    present: bool = False

    @classmethod
    def from_text(cls, text: str) -> "SpecCounters":
        c = cls()
        for name, labels, value in parse_prometheus(text):
            base = name[:-6] if name.endswith("_total") else name
            if base == DRAFTS:
                c.drafts += value
            elif base == DRAFT_TOKENS:
                c.draft_tokens += value
            elif base == ACCEPTED:
                c.accepted += value
            elif base == ACCEPTED_PER_POS and "position" in labels:
                pos = int(labels["position"])
                c.per_pos[pos] = c.per_pos.get(pos, 0.0) + value
            else:
                continue
            c.present = True
        return c

    @classmethod
    def from_vllm_metrics(cls, metrics) -> "SpecCounters":
        """The same counters from an offline engine: ``vllm.LLM.get_metrics()`` (its ``Counter``s carry
        ``.value``; the per-position series is one ``Vector`` per engine, with ``.values`` by position)."""
        c = cls()
        for m in metrics:
            name = m.name[:-6] if m.name.endswith("_total") else m.name
            if name == DRAFTS:
                c.drafts += m.value
            elif name == DRAFT_TOKENS:
                c.draft_tokens += m.value
            elif name == ACCEPTED:
                c.accepted += m.value
            elif name == ACCEPTED_PER_POS:
                for pos, v in enumerate(m.values):
                    c.per_pos[pos] = c.per_pos.get(pos, 0.0) + v
            else:
                continue
            c.present = True
        return c

    def __sub__(self, before: "SpecCounters") -> "SpecCounters":
        positions = sorted(set(self.per_pos) | set(before.per_pos))
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted,
                            {p: self.per_pos.get(p, 0.0) - before.per_pos.get(p, 0.0) for p in positions},
                            self.present or before.present)

    def stats(self) -> AcceptanceStats | None:
        """Acceptance over the interval; None when the server does not speculate."""
        if not self.present or self.drafts <= 0:
            return None
        n = max(self.per_pos) + 1 if self.per_pos else 0
        return AcceptanceStats(steps=self.drafts, drafted=self.draft_tokens, accepted=self.accepted,
                               per_position=[self.per_pos.get(i, 0.0) for i in range(n)], source="metrics")


async def scrape(http: httpx.AsyncClient, base_url: str) -> SpecCounters | None:
    """The server's counters, or None when it has none to give: no ``/metrics`` (404: not every server
    is vLLM), one closed to us (401/403), or one that is not Prometheus text. A point is then measured
    without acceptance figures; it never fails for want of them."""
    try:
        r = await http.get(base_url.rstrip("/") + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        return SpecCounters.from_text(r.text)
    except ValueError:  # e.g. a position label that is not a number: someone else's metric of that name
        return None


def stats_from_responses(metrics: list[dict | None]) -> AcceptanceStats | None:
    """Fallback when ``/metrics`` is unavailable: vLLM's per-request speculative metrics, summed;
    None when no reply carried a drafting step."""
    pooled = AcceptanceStats.pooled(AcceptanceStats.from_vllm(m) for m in metrics if m)
    return pooled if pooled.steps else None
