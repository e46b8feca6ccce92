"""The study's grid: deployment × concurrency (or arrival rate) × temperature × request set.

Each deployment is started once and measured at all its points; every point is
appended to ``results.jsonl`` as soon as it is measured, so a sweep killed at
any moment loses at most the point in flight, and a rerun skips what is done.
A deployment that does not start (missing head, rejected by vLLM) and a point
whose server died are recorded as failed with the reason, and the sweep goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from pydantic import BaseModel, ConfigDict, Field

from ..serving.spec import DeploymentSpec
from .plan import (SweepPlan, baseline, head_available, parse_deployment, preset,  # noqa: F401 (re-exported)
                   spec_deployment)
from .loadgen import ChatRequest, LoadConfig, chat_requests, run_load
from .results import (DeploymentInfo, Machine, PointConfig, PointResult, append_result, finished_keys,
                      load_results, now_iso)

# --- request sets -------------------------------------------------------------


def load_request_set(name: str, n: int, max_tokens: int, structured: bool = False) -> list[ChatRequest]:
    """``commerce`` (the task's test split, search and support mixed), ``search``, ``support``, or a JSONL file."""
    from ..task.data import read_requests
    from ..task.generator import generate

    if name in ("commerce", "search", "support"):
        reqs = generate("test", max(4 * n, 64))
        if name != "commerce":
            reqs = [r for r in reqs if r.task == name]
    else:
        reqs = read_requests(name)
    return chat_requests(reqs[: max(n, 1) + 16], max_tokens, structured)


# --- deployments ---------------------------------------------------------------


class Deployment(Protocol):
    url: str

    def alive(self) -> bool: ...
    def describe(self) -> DeploymentInfo: ...
    def died_reason(self) -> str: ...


class VllmDeployment:
    """A ``VllmServer`` seen through the sweep's eyes."""

    def __init__(self, spec: DeploymentSpec, log_dir: Path):
        from ..serving.server import VllmServer

        self.server = VllmServer(spec, log_dir=log_dir)
        self.spec = spec

    @property
    def url(self) -> str:
        return self.server.url

    def alive(self) -> bool:
        return self.server.alive()

    def describe(self) -> DeploymentInfo:
        from ..paths import dir_digest

        info = self.server.info()
        sp = self.spec.speculative
        for key in ("model_dir", "head_dir"):  # the content, not just the path, says which model ran
            path = Path(info.versions.get(key) or "")
            if str(path) not in ("", ".") and path.is_dir():
                info.versions[key.replace("_dir", "_digest")] = dir_digest(path)[:16]
        return DeploymentInfo(label=self.spec.label, method=sp.method, gamma=sp.num_speculative_tokens,
                              head=info.versions.get("head_dir") or None, model=info.versions.get("model_dir", ""),
                              spec=info.spec, url=info.url, versions=info.versions, log_path=info.log_path)

    def died_reason(self) -> str:
        from ..serving.server import read_log, root_cause

        code = self.server.proc.returncode if self.server.proc else None
        log = read_log(self.server.log_path)
        cause = root_cause(log)
        if cause is None:
            telling = [ln for ln in log.splitlines()[-200:]
                       if any(k in ln.lower() for k in ("error", "killed", "memory"))]
            cause = (telling[-1] if telling else "no error line in log").strip()[-300:]
        return f"vLLM server died (exit code {code}): {cause} (log: {self.server.log_path})"


@contextlib.contextmanager
def launch_vllm(spec: DeploymentSpec, log_dir: Path) -> Iterator[VllmDeployment]:
    dep = VllmDeployment(spec, log_dir)
    dep.server.start()
    try:
        yield dep
    finally:
        dep.server.stop()


class ExternalDeployment:
    """An endpoint someone else runs (vLLM, SGLang, TensorRT-LLM...): measured, never started."""

    def __init__(self, url: str, spec: DeploymentSpec, label: str, served_name: str):
        self.url, self.spec, self.label, self.served_name = url.rstrip("/"), spec, label, served_name

    def alive(self) -> bool:
        import httpx

        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def describe(self) -> DeploymentInfo:
        import httpx

        versions: dict[str, str] = {}
        try:
            r = httpx.get(self.url + "/version", timeout=5)
            if r.status_code == 200:
                versions["server"] = str(r.json().get("version"))
        except (httpx.HTTPError, ValueError):
            pass
        sp = self.spec.speculative
        return DeploymentInfo(label=self.label, method=sp.method, gamma=sp.num_speculative_tokens, head=sp.model,
                              model=self.served_name, spec=self.spec.model_dump(mode="json"), url=self.url,
                              versions=versions)

    def died_reason(self) -> str:
        return f"the endpoint {self.url} stopped answering /health"


Launcher = Callable[[DeploymentSpec, Path], contextlib.AbstractContextManager]


def served_model_name(url: str) -> str:
    import httpx

    r = httpx.get(url.rstrip("/") + "/v1/models", timeout=10)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


# --- the run -----------------------------------------------------------------


class Reporter(Protocol):
    """What the sweep tells the outside world (a rich progress display, or nothing)."""

    def start(self, total: int, done: int) -> None: ...
    def deployment(self, label: str, state: str) -> None: ...
    def point_started(self, cfg: PointConfig) -> None: ...
    def request_done(self, ok: bool) -> None: ...
    def point_finished(self, res: PointResult) -> None: ...
    def stop(self) -> None: ...


class SilentReporter:
    def start(self, total, done): pass
    def deployment(self, label, state): pass
    def point_started(self, cfg): pass
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


def write_run_file(out: Path, plan: SweepPlan, machine: Machine) -> None:
    path = out / "run.json"
    prev = json.loads(path.read_text()) if path.exists() else {}
    runs = prev.get("invocations", [])
    runs.append({"started_at": now_iso()})
    path.write_text(json.dumps({"plan": plan.model_dump(mode="json"), "machine": machine.model_dump(mode="json"),
                                "created_at": prev.get("created_at", now_iso()), "invocations": runs}, indent=2))


def finish_run_file(out: Path, seconds: float, measured: int, skipped: int) -> None:
    path = out / "run.json"
    data = json.loads(path.read_text())
    data["invocations"][-1].update(finished_at=now_iso(), seconds=round(seconds, 1), points_measured=measured,
                                   points_skipped=skipped)
    path.write_text(json.dumps(data, indent=2))


def run_sweep(plan: SweepPlan, out: str | Path, launcher: Launcher | None = None,
              reporter: Reporter | None = None) -> list[PointResult]:
    """Measure every unfinished point of ``plan`` into ``out/results.jsonl``; returns all results."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not plan.server_url:  # record (and key points by) the dtype that runs, not "auto"
        plan = plan.model_copy(update={"deployments": [d.resolved() for d in plan.deployments]})
    reporter = reporter or SilentReporter()
    machine = Machine.here()
    write_run_file(out, plan, machine)
    done = finished_keys(out)
    total = len(plan.all_points())
    skipped = sum(1 for p in plan.all_points() if p.key in done)
    reporter.start(total, skipped)
    t0 = time.monotonic()
    measured = 0
    try:
        for spec in plan.deployments:
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
                    continue
            pending = [p for p in plan.points(spec, label) if p.key not in done]
            if not pending:
                reporter.deployment(label, "done")
                continue
            measured += _run_deployment(plan, spec, pending, out, machine, launcher, reporter)
    finally:
        reporter.stop()
        finish_run_file(out, time.monotonic() - t0, measured, skipped)
    return load_results(out)


def _tuned(plan: SweepPlan, spec: DeploymentSpec, out: Path, launcher: Launcher | None,
           reporter: Reporter) -> DeploymentSpec:
    """An adaptive deployment with its schedule (``bench/adaptive.py`` says where it comes from)."""
    from .adaptive import resolve_adaptive, run_calibration

    def calibrate(s: DeploymentSpec, cal_dir: Path) -> list[PointResult]:
        return run_calibration(s, cal_dir, launcher, _NestedReporter(reporter, "calibration"))

    return resolve_adaptive(spec, out, calibrate, log=lambda msg: reporter.deployment(spec.label, msg))


def _start(plan: SweepPlan, spec: DeploymentSpec, out: Path, launcher: Launcher | None, label: str):
    if plan.server_url:
        name = plan.served_name or served_model_name(plan.server_url)
        return contextlib.nullcontext(ExternalDeployment(plan.server_url, spec, label, name)), name
    return (launcher or launch_vllm)(spec, out / "logs"), spec.name


def _run_deployment(plan: SweepPlan, spec: DeploymentSpec, pending: list[PointConfig], out: Path,
                    machine: Machine, launcher: Launcher | None, reporter: Reporter) -> int:
    """Start one deployment, measure its pending points; a server that dies is restarted once."""
    label = pending[0].deployment
    restarts = 0
    measured = 0
    info: DeploymentInfo | None = None
    while pending:
        reporter.deployment(label, "starting")
        try:
            cm, model_name = _start(plan, spec, out, launcher, label)
            dep = cm.__enter__()
        except Exception as exc:  # a missing head, an engine that rejects the config...
            reason = f"deployment did not start: {getattr(exc, 'reason', None) or exc}"
            reporter.deployment(label, "failed")
            for cfg in pending:
                res = PointResult.failed(cfg, reason[:2000], machine=machine)
                append_result(out, res)
                reporter.point_finished(res)
            return measured + len(pending)
        try:
            info = dep.describe()
            reporter.deployment(label, "running")
            while pending:
                cfg = pending[0]
                res = _measure(plan, cfg, dep, model_name, info, machine, reporter)
                append_result(out, res)
                reporter.point_finished(res)
                pending.pop(0)
                measured += 1
                if res.status == "failed" and not dep.alive():
                    break
        finally:
            cm.__exit__(None, None, None)
        if pending:
            restarts += 1
            if restarts > 1 or plan.server_url:
                reason = "server died twice" if not plan.server_url else dep.died_reason()
                for cfg in pending:
                    res = PointResult.failed(cfg, reason, machine=machine, deployment=info)
                    append_result(out, res)
                    reporter.point_finished(res)
                return measured + len(pending)
    return measured


def reply_quality(records: list, requests: list[ChatRequest]) -> tuple[float | None, float | None]:
    """(JSON-valid share, exact-match share) of a point's answered requests: the guard that catches
    a deployment that is fast because it answers wrongly."""
    from ..task.score import score_item

    by_id = {r.id: r.source for r in requests if r.source is not None}
    scored = []
    for rec in records:
        if rec.ok and rec.text is not None and rec.id in by_id:
            item = score_item(by_id[rec.id], rec.text)
            # kept on the record: the report's paired tests must not re-derive gold later
            rec.task, rec.exact = item.task, item.exact
            scored.append(item)
    if not scored:
        return None, None
    with_gold = [s.exact for s in scored if s.exact is not None]
    return (sum(s.json_valid for s in scored) / len(scored),
            sum(with_gold) / len(with_gold) if with_gold else None)


def _measure(plan: SweepPlan, cfg: PointConfig, dep: Any, model_name: str, info: DeploymentInfo,
             machine: Machine, reporter: Reporter) -> PointResult:
    reporter.point_started(cfg)
    started = now_iso()
    try:
        requests = load_request_set(cfg.request_set, cfg.n_requests + cfg.warmup, cfg.max_tokens, cfg.structured)
        load = LoadConfig(mode=cfg.mode, concurrency=cfg.concurrency or 1, rate=cfg.rate, n_requests=cfg.n_requests,
                          duration_s=cfg.duration_s, warmup=cfg.warmup, temperature=cfg.temperature, seed=cfg.seed)
        result = asyncio.run(run_load(dep.url, model_name, requests, load,
                                      on_done=lambda r: reporter.request_done(r.ok)))
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if not dep.alive():
            reason = dep.died_reason()
        return PointResult.failed(cfg, reason[:2000], started_at=started, machine=machine, deployment=info)
    if not dep.alive():
        return PointResult.failed(cfg, dep.died_reason(), started_at=started, machine=machine, deployment=info,
                                  records=result.records, wall_s=result.wall_s, n_requests=len(result.records),
                                  n_errors=sum(1 for r in result.records if not r.ok))
    json_valid, exact = reply_quality(result.records, requests)
    res = PointResult.measured(cfg, result.records, result.wall_s, result.spec, started_at=started,
                               machine=machine, deployment=info, n_warmup=result.n_warmup,
                               json_valid=json_valid, exact_match=exact)
    if res.n_errors == res.n_requests:
        first = next((r.error for r in result.records if r.error), "")
        return PointResult.failed(cfg, f"every request failed: {first}", started_at=started, machine=machine,
                                  deployment=info, records=result.records, wall_s=result.wall_s,
                                  n_requests=res.n_requests, n_errors=res.n_errors)
    return res


