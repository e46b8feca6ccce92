"""The study's grid: deployment × concurrency (or arrival rate) × temperature × request set.

Each deployment is started once and measured at all its points: one after
another, or (``interleave`` > 1) several up at once and measured in turn at every
point, so that the host's drift lands on all alike; with ``restart_rounds`` the
servers of a group are started again before every round, in rotated order. Every point is appended to
``results.jsonl`` as soon as it is measured, so a sweep killed at any moment loses
at most the point in flight, and a rerun skips what is done.
A deployment that does not start (missing head, rejected by vLLM) and a point
whose server died are recorded as failed with the reason, and the sweep goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from ..serving.endpoint import Endpoint, Launcher, api_key_from_env, endpoint
from ..serving.spec import DeploymentSpec
from .plan import (SweepPlan, baseline, head_available, parse_deployment, preset,  # noqa: F401 (re-exported)
                   spec_deployment)
from .loadgen import ChatRequest, LoadConfig, LoadResult, chat_requests, run_load
from ..results import (DeploymentInfo, Invocation, Machine, PointConfig, PointResult, PointSlice, RequestRecord,
                       RunManifest, append_result, finished_keys, load_results, now_iso)
from ..task.request_sets import load_request_set
from ..task.score import ItemScore, score_item

# --- deployments ---------------------------------------------------------------
# Starting vLLM or using a running endpoint, liveness and descriptions: serving/endpoint.py.


# --- the run -----------------------------------------------------------------


class Reporter(Protocol):
    """What the sweep tells the outside world (a rich progress display, or nothing)."""

    def start(self, total: int, done: int) -> None: ...
    def deployment(self, label: str, state: str) -> None: ...
    def point_started(self, cfg: PointConfig, part: int = 0) -> None: ...  # part: the slice (points in rounds)
    def request_done(self, ok: bool) -> None: ...
    def point_finished(self, res: PointResult) -> None: ...
    def stop(self) -> None: ...


class SilentReporter:
    def start(self, total, done): pass
    def deployment(self, label, state): pass
    def point_started(self, cfg, part=0): pass
    def request_done(self, ok): pass
    def point_finished(self, res): pass
    def stop(self): pass


class _NestedReporter(SilentReporter):
    """A sweep inside a sweep (a calibration): one line per deployment and point, the outer bars untouched."""

    def __init__(self, outer: Reporter, what: str):
        self.outer, self.what = outer, what

    def deployment(self, label, state):
        self.outer.deployment(f"{self.what} {label}", state)

    def point_finished(self, res):
        c = res.config
        tput = f"{res.output_throughput:.1f} tok/s" if res.output_throughput else res.reason or res.status
        self.outer.deployment(f"{self.what} {c.deployment}", f"{c.load} T={c.temperature:g}: {tput}")


def write_run_file(out: Path, plan: SweepPlan, machine: Machine, api_key_env: str | None = None) -> None:
    """Record this invocation in ``run.json`` (the plan and machine are this invocation's)."""
    prev = RunManifest.load(out)
    # the variable's name tells a rerun where the key came from; the key itself is never written
    invocations = [*prev.invocations, Invocation(started_at=now_iso(), server_api_key_env=api_key_env)]
    RunManifest(plan=plan.model_dump(mode="json"), machine=machine, created_at=prev.created_at or now_iso(),
                invocations=invocations).save(out)


def finish_run_file(out: Path, seconds: float, measured: int, skipped: int) -> None:
    manifest = RunManifest.load(out)
    last = manifest.invocations[-1]
    last.finished_at, last.seconds = now_iso(), round(seconds, 1)
    last.points_measured, last.points_skipped = measured, skipped
    manifest.save(out)


def run_sweep(plan: SweepPlan, out: str | Path, launcher: Launcher | None = None,
              reporter: Reporter | None = None, *, api_key_env: str | None = None) -> list[PointResult]:
    """Measure every unfinished point of ``plan`` into ``out/results.jsonl``; returns all results.

    ``launcher``: starts deployments instead of vLLM (``serving.endpoint.Launcher``). ``api_key_env``:
    the environment variable holding ``plan.server_url``'s API key (raises ``MissingApiKey`` when empty);
    the plan and the results hold no key, run.json only this name."""
    api_key = api_key_from_env(api_key_env)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not plan.server_url:  # record (and key points by) the dtype that runs, not "auto"
        plan = plan.model_copy(update={"deployments": [_shares_host(d.resolved(), plan.interleave)
                                                       for d in plan.deployments]})
    reporter = reporter or SilentReporter()
    machine = Machine.here()
    write_run_file(out, plan, machine, api_key_env)
    done = finished_keys(out)
    total = len(plan.all_points())
    skipped = sum(1 for p in plan.all_points() if p.key in done)
    reporter.start(total, skipped)
    t0 = time.monotonic()
    measured = 0
    try:
        def prepare(spec: DeploymentSpec) -> tuple[DeploymentSpec, list[PointConfig]] | None:
            """The deployment as it will run (an adaptive one tuned) and its unfinished points; None: nothing
            to measure (all done, or failed here and recorded)."""
            label = spec.label
            if plan.server_url and spec.speculative.method == "none" and len(plan.deployments) == 1 \
                    and spec.model != "commerce":
                label = spec.model  # an unlabelled external endpoint: named after its model
            if spec.speculative.adaptive and not spec.speculative.schedule:
                try:
                    spec = _tuned(plan, spec, out, launcher, reporter)
                except Exception as exc:  # no head, a calibration that failed...
                    reason = f"adaptive schedule could not be tuned: {type(exc).__name__}: {exc}"
                    reporter.deployment(label, "failed")
                    for cfg in plan.points(spec, label):
                        res = PointResult.failed(cfg, reason[:2000], machine=machine)
                        append_result(out, res)
                        reporter.point_finished(res)
                    return None
            pending = [p for p in plan.points(spec, label) if p.key not in done]
            if not pending:
                reporter.deployment(label, "done")
                return None
            return spec, pending

        if plan.interleave > 1 and not plan.server_url:
            # every schedule is tuned before any server of the group starts
            todo = [x for x in map(prepare, plan.deployments) if x is not None]
            tuned = [spec for spec, _ in todo if spec.speculative.adaptive]
            while todo:  # as many servers at once as the plan and the host's memory allow
                measured += _run_group(plan, todo, out, machine, launcher, reporter, api_key)
            from .adaptive import refresh_cache

            for spec in tuned:  # what this run measured side by side tunes the next run's schedule
                refresh_cache(spec, out, log=lambda msg, s=spec: reporter.deployment(s.label, msg))
        else:
            for spec in plan.deployments:  # an adaptive deployment is tuned when reached: from this run's points
                ready = prepare(spec)
                if ready is not None:
                    measured += _run_group(plan.model_copy(update={"interleave": 1}), [ready], out, machine,
                                           launcher, reporter, api_key)
    finally:
        reporter.stop()
        finish_run_file(out, time.monotonic() - t0, measured, skipped)
    return load_results(out)


def _shares_host(spec: DeploymentSpec, servers: int) -> DeploymentSpec:
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


# Memory an interleaved group keeps free beyond what its last server took (GiB).
_MEMORY_MARGIN_GIB = 1.0


def _available_gib() -> float:
    import psutil

    return psutil.virtual_memory().available / 2**30


def _run_group(plan: SweepPlan, todo: list[tuple[DeploymentSpec, list[PointConfig]]], out: Path,
               machine: Machine, launcher: Launcher | None, reporter: Reporter, api_key: str | None) -> int:
    """Start up to ``plan.interleave`` of the deployments in ``todo`` (fewer when the host's memory would not
    hold another: a server is started only while the memory left exceeds what the last one took), then measure
    each point of the grid on every started deployment in turn, the order rotating from one point to the next
    (one deployment: its points in order). A point in rounds is measured slice by slice, every deployment
    taking its turn at each slice, the order rotating from slice to slice (with ``plan.restart_rounds``: round
    by round, see ``_restarting_rounds``). Started deployments are removed from ``todo``; returns the number
    of points recorded."""
    measured = 0
    group: list[_Live] = []
    with contextlib.ExitStack() as stack:
        took = 0.0
        while todo and len(group) < plan.interleave:
            free = _available_gib()
            if group and free < took + _MEMORY_MARGIN_GIB:
                reporter.deployment(todo[0][1][0].deployment, f"deferred to the next group: {free:.1f} GiB free, "
                                                              f"the last server took {took:.1f}")
                break
            spec, pending = todo.pop(0)
            before = free
            live = _Live(plan, spec, pending, out, launcher, reporter, api_key, machine)
            stack.callback(live.stop)
            if live.start():
                group.append(live)
                took = max(0.0, before - _available_gib())
            else:
                measured += live.fail_rest(live.reason)
        for live in group:
            live.beside = [other.label for other in group if other is not live]
        cells: list[tuple] = []
        for live in group:
            for cfg in live.pending:
                if _cell(cfg) not in cells:
                    cells.append(_cell(cfg))
        if plan.restart_rounds and len(group) > 1:
            return measured + _restarting_rounds(group, cells, plan.rounds)
        turn = 0
        for cell in cells:
            rounds = max((len(c.slice_bounds()) for live in group for c in live.pending if _cell(c) == cell),
                         default=1)
            for j in range(rounds):
                measured += _turns(group, cell, j, turn)
                turn += 1
    return measured


def _turns(group: list[_Live], cell: tuple, part: int, turn: int) -> int:
    """Slice ``part`` of ``cell``'s point on every deployment of the group, starting with deployment
    ``turn`` (mod the group) so that no deployment always goes first."""
    k = turn % max(len(group), 1)
    measured = 0
    for live in group[k:] + group[:k]:
        cfg = next((c for c in live.pending if _cell(c) == cell), None)
        if cfg is not None and part < len(cfg.slice_bounds()):
            measured += live.measure(cfg, part)
    return measured


def _restarting_rounds(group: list[_Live], cells: list[tuple], rounds: int) -> int:
    """Round by round: slice j of every cell on every deployment, then every server stopped and started again
    in a start order rotated by one. Two identical servers of one group can differ by several percent for as
    long as they run (measured on a 2-core CPU: 12% at 32 streams, the server started second the slower);
    restarting them in rotated order spreads that offset over every deployment's slices, where the paired
    intervals see it as noise, instead of biasing one deployment's ratio. A fresh server warms up before its
    first slice."""
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
        for cell in cells:
            measured += _turns(group, cell, j, turn)
            turn += 1
    return measured


def _cell(cfg: PointConfig) -> tuple:
    """What a point is apart from its deployment: the grid cell every deployment is measured at."""
    return (cfg.request_set, cfg.temperature, cfg.mode, cfg.concurrency, cfg.rate)


class _Live:
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
        self.parts: dict[str, list[_Slice]] = {}  # the slices of points in rounds measured so far
        self.beside: list[str] = []  # the other deployments of the group, measured in turn with this one
        self.fresh = False  # started since its last slice: the next slice warms it up first

    def start(self) -> bool:
        self.reporter.deployment(self.label, "starting")
        self.stack = contextlib.ExitStack()
        try:
            self.ep = self.stack.enter_context(_endpoint(self.plan, self.spec, self.out, self.launcher, self.label,
                                                         self.api_key))
        except Exception as exc:  # a missing head, an engine that rejects the config...
            self.stop()
            self.reason = f"deployment did not start: {getattr(exc, 'reason', None) or exc}"
            self.reporter.deployment(self.label, "failed")
            return False
        self.info = self.ep.describe()
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
        res = _measure(cfg, self.ep, self.info, self.machine, self.reporter, part=part, done=done,
                       warm=part == 0 or self.fresh)
        self.fresh = False
        if isinstance(res, _Slice):
            done.append(res)
            if part + 1 < len(bounds):
                return 0
            res = _merged(cfg, done, self.info, self.machine, self.beside)
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


def _tuned(plan: SweepPlan, spec: DeploymentSpec, out: Path, launcher: Launcher | None,
           reporter: Reporter) -> DeploymentSpec:
    """An adaptive deployment with its schedule (``bench/adaptive.py`` says where it comes from)."""
    from .adaptive import resolve_adaptive, run_calibration

    def calibrate(s: DeploymentSpec, cal_dir: Path) -> list[PointResult]:
        return run_calibration(s, cal_dir, launcher, _NestedReporter(reporter, "calibration"))

    return resolve_adaptive(spec, out, calibrate, log=lambda msg: reporter.deployment(spec.label, msg))


def _endpoint(plan: SweepPlan, spec: DeploymentSpec, out: Path, launcher: Launcher | None, label: str,
              api_key: str | None) -> contextlib.AbstractContextManager[Endpoint]:
    if plan.server_url:  # measured, never started: ``spec`` only says what runs there
        return endpoint(plan.server_url, log_dir=out / "logs", api_key=api_key, served_name=plan.served_name,
                        runs=spec, label=label)
    return endpoint(spec, log_dir=out / "logs", launcher=launcher, api_key=api_key)


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


def with_samples(requests: list[ChatRequest], n: int, samples: int) -> list[ChatRequest]:
    """The first ``n`` requests, each ``samples`` times in a row (sample 0, 1, ...), then the rest (the
    warm-up takes its requests from the end). The load generator seeds the i-th measured request
    ``seed * 100003 + i``, so sample j of request r gets seed ``seed * 100003 + r * samples + j`` on every
    deployment: a speculative reply pairs with the baseline's drawn with the same seed."""
    if samples <= 1:
        return requests
    import dataclasses

    head = [dataclasses.replace(r, sample=j) for r in requests[:n] for j in range(samples)]
    return head + list(requests[n:])


@dataclass
class _Slice:
    """One slice of a point, measured; the point's slices merge into its result (``_merged``)."""

    started_at: str
    load: LoadResult
    requests: list[ChatRequest]


def _measure(cfg: PointConfig, ep: Endpoint, info: DeploymentInfo, machine: Machine, reporter: Reporter,
             part: int = 0, done: Sequence[_Slice] = (), warm: bool = True) -> _Slice | PointResult:
    """Run slice ``part`` of ``cfg``, after the point's warm-up where ``warm`` (its first slice, and the first
    slice on a server that was just started); a failed point when the slice fails or the server died (with the
    records of the slices ``done`` before it and this one's)."""
    started = now_iso()
    bounds = cfg.slice_bounds()
    offset, count = bounds[part]
    try:
        if done:  # the point's request list, built for its first slice
            requests = done[0].requests
        else:
            requests = chat_requests(load_request_set(cfg.request_set, cfg.n_requests + cfg.warmup),
                                     cfg.max_tokens, cfg.structured)
            requests = with_samples(requests, cfg.n_requests, cfg.samples)
        load = LoadConfig(mode=cfg.mode, concurrency=cfg.concurrency or 1, rate=cfg.rate, n_requests=count,
                          offset=offset, warmup=cfg.warmup if warm else 0,
                          duration_s=cfg.duration_s / len(bounds) if cfg.duration_s else None,
                          temperature=cfg.temperature, seed=cfg.seed)
        result = asyncio.run(run_load(ep.url, ep.served_name, requests, load,
                                      on_done=lambda r: reporter.request_done(r.ok), api_key=ep.api_key,
                                      metrics=ep.has_metrics))
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if not ep.alive():
            reason = ep.died_reason()
        return _failed(cfg, reason, done, None, started, info, machine)
    if not ep.alive():
        return _failed(cfg, ep.died_reason(), done, result, started, info, machine)
    return _Slice(started, result, requests)


def _failed(cfg: PointConfig, reason: str, done: Sequence[_Slice], last: LoadResult | None, started: str,
            info: DeploymentInfo, machine: Machine) -> PointResult:
    """The point failed in a slice: recorded with the requests of the slices before it (and of the failed one
    when it ran to its end)."""
    records = [rec for s in done for rec in s.load.records] + (last.records if last else [])
    wall = sum(s.load.wall_s for s in done) + (last.wall_s if last else 0.0)
    return PointResult.failed(cfg, reason[:2000], started_at=done[0].started_at if done else started,
                              machine=machine, deployment=info, records=records, wall_s=wall,
                              n_requests=len(records), n_errors=sum(1 for r in records if not r.ok))


def _merged(cfg: PointConfig, slices: Sequence[_Slice], info: DeploymentInfo, machine: Machine,
            beside: Sequence[str] = ()) -> PointResult:
    """The point from its slices: their records on one clock (each slice's after the wall time of those
    before it), wall times and acceptance counters summed; each slice's own figures kept in ``slices``."""
    records: list[RequestRecord] = []
    acceptance = None
    shift = 0.0
    for s in slices:
        records += [rec.model_copy(update={"start": rec.start + shift}) for rec in s.load.records]
        shift += s.load.wall_s
        if s.load.acceptance is not None:
            acceptance = s.load.acceptance if acceptance is None else acceptance + s.load.acceptance
    scores = score_replies(records, slices[0].requests)
    json_valid, exact = reply_quality(scores)
    records = with_scores(records, scores)
    parts = [PointSlice(started_at=s.started_at, wall_s=s.load.wall_s, n_requests=len(s.load.records),
                        output_tokens=sum(r.output_tokens for r in s.load.records if r.ok))
             for s in slices] if len(slices) > 1 else []
    res = PointResult.measured(cfg, records, shift, acceptance, started_at=slices[0].started_at,
                               machine=machine, deployment=info, n_warmup=sum(s.load.n_warmup for s in slices),
                               json_valid=json_valid, exact_match=exact, slices=parts,
                               beside=list(beside) if parts else [])
    if res.n_errors == res.n_requests:
        first = next((r.error for r in records if r.error), "")
        return PointResult.failed(cfg, f"every request failed: {first}", started_at=slices[0].started_at,
                                  machine=machine, deployment=info, records=records, wall_s=shift,
                                  n_requests=res.n_requests, n_errors=res.n_errors)
    return res
