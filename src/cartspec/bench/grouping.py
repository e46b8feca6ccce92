"""Deployments measured side by side: memory-aware groups, rounds, and each server's restart policy.

``run_group`` starts as many of the sweep's deployments at once as the plan's ``interleave`` and the host's
memory allow, then measures every grid cell on each of them in turn, the order rotating from cell to cell
(and, for a point in rounds, slice by slice) so that the host's drift lands on all deployments alike.
``bench/sweep.py`` holds the loop that calls it; ``bench/slices.py`` measures and merges a point's slices.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..model.heads import version_of
from ..results import DeploymentInfo, Machine, PointConfig, PointResult, append_result
from ..serving.endpoint import Endpoint, Launcher, endpoint
from ..serving.spec import DeploymentSpec
from .plan import SweepPlan
from .reporter import Reporter
from .slices import Slice, measure_slice, merged_point

# Memory an interleaved group keeps free beyond what its last server took (GiB).
MEMORY_MARGIN_GIB = 1.0


def available_gib() -> float:
    import psutil

    return psutil.virtual_memory().available / 2**30


def shares_host(spec: DeploymentSpec, servers: int) -> DeploymentSpec:
    """``spec`` made to share the host with ``servers - 1`` other servers: a KV cache sized to what it
    holds (CPU) or its share of each GPU's memory, unless the spec sets its own."""
    if servers <= 1:
        return spec
    from ..serving.engine import has_cuda

    if has_cuda():
        if spec.gpu_memory_utilization is None:
            return spec.model_copy(update={"gpu_memory_utilization": round(0.85 / servers, 3)})
        return spec
    return spec if spec.kv_cache_fit is not None else spec.model_copy(update={"kv_cache_fit": True})


def cell(cfg: PointConfig) -> tuple:
    """What a point is apart from its deployment: the grid cell every deployment is measured at."""
    return (cfg.request_set, cfg.temperature, cfg.mode, cfg.concurrency, cfg.rate)


def run_group(plan: SweepPlan, todo: list[tuple[DeploymentSpec, list[PointConfig]]], out: Path,
              machine: Machine, launcher: Launcher | None, reporter: Reporter, api_key: str | None) -> int:
    """Start up to ``plan.interleave`` of the deployments in ``todo`` (fewer when the host's memory would not
    hold another: a server is started only while the memory left exceeds what the last one took), then measure
    each point of the grid on every started deployment in turn, the order rotating from one point to the next
    (one deployment: its points in order). A point in rounds is measured slice by slice, every deployment
    taking its turn at each slice, the order rotating from slice to slice (with ``plan.restart_rounds``: round
    by round, see ``restarting_rounds``). Started deployments are removed from ``todo``; returns the number
    of points recorded."""
    measured = 0
    group: list[LiveDeployment] = []
    with contextlib.ExitStack() as stack:
        took = 0.0
        while todo and len(group) < plan.interleave:
            free = available_gib()
            if group and free < took + MEMORY_MARGIN_GIB:
                reporter.deployment(todo[0][1][0].deployment, f"deferred to the next group: {free:.1f} GiB free, "
                                                              f"the last server took {took:.1f}")
                break
            spec, pending = todo.pop(0)
            before = free
            live = LiveDeployment(plan, spec, pending, out, launcher, reporter, api_key, machine)
            stack.callback(live.stop)
            if live.start():
                group.append(live)
                took = max(0.0, before - available_gib())
            else:
                measured += live.fail_rest(live.reason)
        for live in group:
            live.beside = [other.label for other in group if other is not live]
        cells: list[tuple] = []
        for live in group:
            for cfg in live.pending:
                if cell(cfg) not in cells:
                    cells.append(cell(cfg))
        if plan.restart_rounds and len(group) > 1:
            return measured + restarting_rounds(group, cells, plan.rounds)
        turn = 0
        for c in cells:
            rounds = max((len(p.slice_bounds()) for live in group for p in live.pending if cell(p) == c), default=1)
            for j in range(rounds):
                measured += turns(group, c, j, turn)
                turn += 1
    return measured


def turns(group: list[LiveDeployment], at: tuple, part: int, turn: int) -> int:
    """Slice ``part`` of cell ``at``'s point on every deployment of the group, starting with deployment
    ``turn`` (mod the group) so that no deployment always goes first."""
    k = turn % max(len(group), 1)
    measured = 0
    for live in group[k:] + group[:k]:
        cfg = next((c for c in live.pending if cell(c) == at), None)
        if cfg is not None and part < len(cfg.slice_bounds()):
            measured += live.measure(cfg, part)
    return measured


def restarting_rounds(group: list[LiveDeployment], cells: list[tuple], rounds: int) -> int:
    """Round by round: slice j of every cell on every deployment, then every server stopped and started again
    in a start order rotated by one. Two identical servers of one group can differ by several percent for as
    long as they run (docs/study.md, "Why restart between rounds"); restarting them in rotated order spreads
    that offset over every deployment's slices, where the paired intervals see it as noise, instead of biasing
    one deployment's ratio. A fresh server warms up before its first slice."""
    measured, turn = 0, 0
    for j in range(rounds):
        if j > 0:
            if not any(live.pending for live in group):
                break
            for live in group:
                live.stop()
            k = j % len(group)
            for live in group[k:] + group[:k]:
                if live.pending and not live.start():
                    measured += live.fail_rest(live.reason)
        for c in cells:
            measured += turns(group, c, j, turn)
            turn += 1
    return measured


def deployment_endpoint(plan: SweepPlan, spec: DeploymentSpec, out: Path, launcher: Launcher | None, label: str,
                        api_key: str | None) -> contextlib.AbstractContextManager[Endpoint]:
    """The deployment's endpoint: started here, or (``plan.server_url``) one that runs already."""
    if plan.server_url:  # measured, never started: ``spec`` only says what runs there
        return endpoint(plan.server_url, log_dir=out / "logs", api_key=api_key, served_name=plan.served_name,
                        runs=spec, label=label)
    return endpoint(spec, log_dir=out / "logs", launcher=launcher, api_key=api_key)


class LiveDeployment:
    """One deployment of a group: its server, its pending points, one restart after a death."""

    def __init__(self, plan: SweepPlan, spec: DeploymentSpec, pending: list[PointConfig], out: Path,
                 launcher: Launcher | None, reporter: Reporter, api_key: str | None, machine: Machine):
        self.plan, self.spec, self.pending, self.out = plan, spec, list(pending), out
        self.launcher, self.reporter, self.api_key, self.machine = launcher, reporter, api_key, machine
        self.label = pending[0].deployment
        self.stack: contextlib.ExitStack | None = None
        self.ep: Endpoint | None = None
        self.info: DeploymentInfo | None = None
        self.restarts = 0
        self.reason = ""
        self.parts: dict[str, list[Slice]] = {}  # the slices of points in rounds measured so far
        self.beside: list[str] = []  # the other deployments of the group, measured in turn with this one
        self.fresh = False  # started since its last slice: the next slice warms it up first

    def start(self) -> bool:
        self.reporter.deployment(self.label, "starting")
        self.stack = contextlib.ExitStack()
        try:
            self.ep = self.stack.enter_context(deployment_endpoint(self.plan, self.spec, self.out, self.launcher,
                                                                   self.label, self.api_key))
        except Exception as exc:  # a missing head, an engine that rejects the config...
            self.stop()
            self.reason = f"deployment did not start: {getattr(exc, 'reason', None) or exc}"
            self.reporter.deployment(self.label, "failed")
            return False
        self.info = self.ep.describe()
        if not self.info.head_version:  # the version the server loaded, else the one the points were planned with
            self.info.head_version = (version_of(self.info.head) if self.info.head else None) \
                or self.pending[0].head_version
        self.fresh = True
        self.reporter.deployment(self.label, "running")
        return True

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.close()
        self.stack, self.ep = None, None

    def _record(self, res: PointResult) -> None:
        append_result(self.out, res)
        self.reporter.point_finished(res)

    def fail_rest(self, reason: str) -> int:
        for cfg in self.pending:
            self._record(PointResult.failed(cfg, reason[:2000], machine=self.machine, deployment=self.info))
        n, self.pending = len(self.pending), []
        return n

    def measure(self, cfg: PointConfig, part: int = 0) -> int:
        """Measure slice ``part`` of ``cfg`` (the whole point when it is not in rounds); the point is recorded
        after its last slice, or failed at the first slice that fails. A server that died is restarted once,
        then its points fail. Returns the number of points recorded."""
        if self.ep is None:
            return 0
        bounds = cfg.slice_bounds()
        if part == 0:
            self.parts[cfg.key] = []
        self.reporter.point_started(cfg, part)
        done = self.parts[cfg.key]
        res = measure_slice(cfg, self.ep, self.info, self.machine, self.reporter, part=part, done=done,
                            warm=part == 0 or self.fresh)
        self.fresh = False
        if isinstance(res, Slice):
            done.append(res)
            if part + 1 < len(bounds):
                return 0
            res = merged_point(cfg, done, self.info, self.machine, self.beside)
        del self.parts[cfg.key]
        self._record(res)
        self.pending.remove(cfg)
        if res.status == "failed" and not self.ep.alive():
            died = self.ep.died_reason()
            self.stop()
            self.restarts += 1
            if self.plan.server_url:  # not ours to restart
                return 1 + self.fail_rest(died)
            if self.restarts > 1:
                return 1 + self.fail_rest(f"server died twice: {died}")
            if self.pending and not self.start():
                return 1 + self.fail_rest(self.reason)
        return 1
