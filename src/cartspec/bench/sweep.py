"""The study's grid: deployment × concurrency (or arrival rate) × temperature × request set.

Each deployment is started once and measured at all its points: one after
another, or (``interleave`` > 1) several up at once and measured in turn at every
point, so that the host's drift lands on all alike; with ``restart_rounds`` the
servers of a group are started again before every round, in rotated order. Every point is appended to
``results.jsonl`` as soon as it is measured, so a sweep killed at any moment loses
at most the point in flight, and a rerun skips what is done.
A deployment that does not start (missing head, rejected by vLLM) and a point
whose server died are recorded as failed with the reason, and the sweep goes on.

This module holds the loop, the run's manifest, the adaptive hook and the calibration sweep that tunes an
adaptive deployment where nothing else can (``run_calibration``, ``serving_schedule``); a group of servers
measured side by side, its rounds and restarts live in ``bench/grouping.py``, a point's slices and their
merging in ``bench/slices.py``, its replies' scores in ``bench/scoring.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from ..results import (Invocation, Machine, PointConfig, PointResult, RunManifest, append_result, finished_keys,
                       load_results, now_iso, patch_summary)
from ..serving.endpoint import Launcher, api_key_from_env
from ..serving.spec import DeploymentSpec
from ..serving.urls import redact_url
from .grouping import run_group, shares_host
from .plan import (SweepPlan, baseline, head_available, parse_deployment, preset,  # noqa: F401 (re-exported)
                   spec_deployment)
from .reporter import NestedReporter, Reporter, SilentReporter


def write_run_file(out: Path, plan: SweepPlan, machine: Machine, api_key_env: str | None = None) -> None:
    """Record this invocation in ``run.json`` (the plan and machine are this invocation's)."""
    prev = RunManifest.load(out)
    # the variable's name tells a rerun where the key came from; the key itself is never written
    invocations = [*prev.invocations, Invocation(started_at=now_iso(), server_api_key_env=api_key_env)]
    recorded = plan.model_dump(mode="json")
    if recorded.get("server_url"):  # a URL's user:password@ or ?key= is a credential too
        recorded["server_url"] = redact_url(recorded["server_url"])
    RunManifest(plan=recorded, machine=machine, created_at=prev.created_at or now_iso(),
                invocations=invocations).save(out)


def finish_run_file(out: Path, seconds: float, measured: int, skipped: int) -> None:
    manifest = RunManifest.load(out)
    last = manifest.invocations[-1]
    last.finished_at, last.seconds = now_iso(), round(seconds, 1)
    last.points_measured, last.points_skipped = measured, skipped
    last.vllm_patches = patch_summary(load_results(out)) or None  # what the vLLM plugin did in the deployments
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
        plan = plan.model_copy(update={"deployments": [shares_host(d.resolved(), plan.interleave)
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
                measured += run_group(plan, todo, out, machine, launcher, reporter, api_key)
            from .adaptive import refresh_cache

            for spec in tuned:  # what this run measured side by side tunes the next run's schedule
                refresh_cache(spec, out, log=lambda msg, s=spec: reporter.deployment(s.label, msg))
        else:
            for spec in plan.deployments:  # an adaptive deployment is tuned when reached: from this run's points
                ready = prepare(spec)
                if ready is not None:
                    measured += run_group(plan.model_copy(update={"interleave": 1}), [ready], out, machine,
                                          launcher, reporter, api_key)
    finally:
        reporter.stop()
        finish_run_file(out, time.monotonic() - t0, measured, skipped)
    return load_results(out)


def _tuned(plan: SweepPlan, spec: DeploymentSpec, out: Path, launcher: Launcher | None,
           reporter: Reporter) -> DeploymentSpec:
    """An adaptive deployment with its schedule (``bench/adaptive.py`` says where it comes from)."""
    from .adaptive import resolve_adaptive

    def calibrate(s: DeploymentSpec, cal_dir: Path) -> list[PointResult]:
        return run_calibration(s, cal_dir, launcher, NestedReporter(reporter, "calibration"))

    return resolve_adaptive(spec, out, calibrate, log=lambda msg: reporter.deployment(spec.label, msg))


def run_calibration(spec: DeploymentSpec, cal_dir: Path, launcher=None, reporter=None) -> list[PointResult]:
    """The ``calibrate`` preset for ``spec``'s target and head, under ``spec``'s engine settings."""
    cal = preset("calibrate", spec.model, spec.speculative.model)
    same = {k: getattr(spec, k) for k in ("dtype", "enforce_eager", "max_model_len", "max_num_seqs", "env",
                                          "engine_args", "start_timeout_s")}
    cal.deployments = [d.model_copy(update=same) for d in cal.deployments]
    return run_sweep(cal, cal_dir, launcher, reporter)


def serving_schedule(spec: DeploymentSpec, log: Callable[[str], None] = print) -> DeploymentSpec:
    """An adaptive ``spec`` to serve (``agent.defaults.adaptive_request``) with the schedule cached for this
    machine, else one from a calibration run into the cache first (its own directory under ``tune_dir()``)."""
    from .adaptive import resolve_adaptive

    return resolve_adaptive(spec, None, run_calibration, log=log)
