"""Capacity under the SLO: the most goodput one instance gives, and the instances a target load needs."""

from __future__ import annotations

import math

from .models import CapacityRow, StudyRow


def capacity_table(rows: list[StudyRow], target_rps: float | None) -> tuple[list[CapacityRow], float | None]:
    """Per deployment (and temperature): the most goodput one instance gives under the SLO, and
    how many instances a target load needs. Default target: twice the baseline's capacity at T=0,
    the study's "one GPU instead of two" question restated for this machine."""
    groups: dict[tuple, list[StudyRow]] = {}
    for r in rows:
        if r.ok:
            groups.setdefault((r.deployment, r.temperature, r.request_set), []).append(r)
    caps = []
    for (dep, temp, rs), pts in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        best = max(pts, key=lambda p: p.goodput or 0.0)
        caps.append(CapacityRow(deployment=dep, method=best.method, gamma=best.gamma, temperature=temp,
                                request_set=rs, capacity_rps=best.goodput or 0.0,
                                at_load=best.concurrency if best.mode == "closed" else best.rate,
                                mode=best.mode, slo_attainment=best.slo_attainment, e2el_p99=best.e2el_p99))
    if target_rps is None:
        b = [c for c in caps if c.method == "none"]
        b0 = min(b, key=lambda c: c.temperature) if b else None
        target_rps = 2 * b0.capacity_rps if b0 and b0.capacity_rps > 0 else None
    for c in caps:
        c.target_rps = target_rps
        c.instances_needed = (math.ceil(target_rps / c.capacity_rps - 1e-9)
                              if target_rps and c.capacity_rps > 0 else None)
    return caps, target_rps
