"""Each hybrid point beside the head alone at the same γ and load: how much of its τ gain became speed.

A hybrid (``hybrid:HEAD:γ``) drafts the head's tokens with the prompt's copies combined in, so beside the same
head alone at the same γ (``eagle3:HEAD:γ``, the same draft length per request or none), load, temperature and
request set it differs in two things only: its τ and its own work per step. Its output throughput over the
head's (``ratio``) is read against what the τ gain can buy. A reply of L tokens takes one step to prefill
its prompt and (L − 1) / τ steps to decode, and each step advances the whole batch; so τ shortens every step
but a request's first, and a prefilling step's time above a decoding step's (its prompt's tokens) stays as it
was. That part is the share ``s`` of the head point's step time (``StudyRow.fixed_time_share``, from the
engine's step counters: ``vllm_plugin.steps.fixed_share``). With equal step costs the hybrid would run

    attainable = 1 / ((1 − s) / r + s),        r = τ_hybrid / τ_head

times the head, and ``kept`` = (ratio − 1) / (attainable − 1) is the share of that gain it kept (1: its own
work cost nothing; above 1: its steps ran cheaper than the head's, which is noise between two servers).
``goal`` is 1 + 0.8 (r − 1), the hybrid keeping 80% of its τ gain as if every step decoded: where the fixed
share is a fifth of the time or more, ``goal`` reaches ``attainable`` or passes it, and no drafter can meet it
(``goal_attainable`` False). At one stream ``s`` is the prefilling steps' whole time; at several it is much
less than their time (``StudyRow.prefill_time_share``), since such a step also decodes the other requests.
"""

from __future__ import annotations

from ..results import PointResult
from .models import PairRow, StudyRow
from .rows import attainable, slice_ratio_ci
from .specs import measured_spec

GOAL_SHARE = 0.8  # of the τ gain, the share the hybrid is to keep as speed (``goal``)


def _draft_stop(r: StudyRow, specs: dict) -> float | None:
    spec = specs.get(r.deployment)
    return spec.speculative.draft_stop if spec else None


def pair_table(rows: list[StudyRow], results: list[PointResult]) -> list[PairRow]:
    """Each hybrid point beside the head-alone point of the same head, γ, draft stop, load, temperature and
    request set (module doc); hybrids without such a point are left out."""
    specs = {r.config.deployment: measured_spec(r.config) for r in results}
    by_key = {r.key: r for r in results}
    ok = [r for r in rows if r.ok and r.output_throughput and r.tau]
    out = []
    for a in ok:
        if a.method != "hybrid":
            continue
        b = next((r for r in ok if r.method == "eagle3" and r.head == a.head and r.gamma == a.gamma
                  and _draft_stop(r, specs) == _draft_stop(a, specs) and r.point == a.point), None)
        if b is None:
            continue
        r_tau = a.tau / b.tau
        ratio = a.output_throughput / b.output_throughput
        goal = 1.0 + GOAL_SHARE * (r_tau - 1.0)
        att = kept = None
        if b.fixed_time_share is not None:
            att = attainable(r_tau, b.fixed_time_share)
            kept = (ratio - 1.0) / (att - 1.0) if abs(att - 1.0) > 1e-9 else None
        out.append(PairRow(
            deployment=a.deployment, head_deployment=b.deployment, temperature=a.temperature, mode=a.mode,
            concurrency=a.concurrency, rate=a.rate, request_set=a.request_set, gamma=a.gamma,
            tau=a.tau, head_tau=b.tau, tau_ratio=r_tau, ratio=ratio,
            ratio_ci95=slice_ratio_ci(by_key[a.key], by_key[b.key]) if a.key in by_key and b.key in by_key else None,
            goal=goal, meets_goal=ratio >= goal, fixed_time_share=b.fixed_time_share, attainable=att,
            kept=kept, goal_attainable=None if att is None else goal <= att,
            draft_ms=a.draft_ms, head_draft_ms=b.draft_ms, decode_ms=a.decode_ms, head_decode_ms=b.decode_ms))
    return sorted(out, key=lambda r: (r.deployment, r.request_set, r.temperature, r.concurrency or 0, r.rate or 0))
