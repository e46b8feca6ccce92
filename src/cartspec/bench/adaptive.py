"""Adaptive deployments in a study: the γ-per-batch-size schedule tuned for this machine.

A deployment labelled ``eagle3:HEAD:auto`` has no fixed γ. When the study reaches it (an
interleaved study: before any server starts), its schedule comes from, in order:

0. this run's points of that deployment, when an earlier invocation measured some: a resumed
   run goes on with the schedule it started with;
1. this run's own points, when they hold the baseline and that head at two or more loads
   (the ``paper`` preset measures them before the adaptive row): measured minutes ago on this
   machine, they beat any earlier tuning;
2. the schedule cached for this machine, dtype, target and head (``$CARTSPEC_HOME/tune/``);
3. a calibration (``--preset calibrate``, a few minutes; ``sweep.run_calibration``) run into the cache first.

Whichever it was, the tuned spec is cached, so ``cartspec serve --adaptive`` and a rerun of the
study use the same schedule; the run's log says which source was used. After an interleaved study the
cache is tuned again from its side-by-side points, pooled with those of the runs that refreshed it
before (the last ``POOL_RUNS`` whose results are still on disk): one run's noise at a load would
otherwise swing the schedule from run to run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..paths import config_digest, home
from ..analysis.specs import measured_spec
from ..serving.spec import DeploymentSpec
from ..results import PointResult, load_results


def tune_dir() -> Path:
    p = home() / "tune"
    p.mkdir(parents=True, exist_ok=True)
    return p


def cache_key(spec: DeploymentSpec) -> str:
    """Which machine, engine settings, target and head a schedule was tuned for."""
    from ..model.registry import resolve_head, resolve_model
    from ..paths import dir_digest
    from ..serving.engine import engine_versions, resolve_dtype

    v = engine_versions()
    head = resolve_head(spec.speculative.model)
    return config_digest({
        "hardware": v.get("hardware"), "cpu": v.get("cpu"), "cores": v.get("machine"), "engine": v.get("vllm"),
        "dtype": resolve_dtype(spec.dtype), "max_num_seqs": spec.max_num_seqs, "enforce_eager": spec.enforce_eager,
        "model": Path(resolve_model(spec.model)).name,  # cached model dirs are named by content hash
        "head": dir_digest(head, only=["config.json", "model.safetensors"])[:16]})


def tune_from(results: list[PointResult] | list[list[PointResult]], spec: DeploymentSpec) -> DeploymentSpec:
    """The adaptive spec with its schedule, tuned from ``results`` (one run's points, or several runs'; raises
    ValueError when they cannot say)."""
    from ..analysis.tune import tune_schedule

    tuned = tune_schedule(results, head=spec.speculative.model, max_batch=spec.max_num_seqs)
    return adaptive_spec(spec, tuned.schedule)


def adaptive_spec(spec: DeploymentSpec, schedule: list[tuple[int, int, int]]) -> DeploymentSpec:
    """``spec`` with this schedule. A schedule that never speculates still loads the head (γ capped at 1,
    0 at every batch size), so the point stays labelled as the adaptive deployment and vLLM drafts nothing."""
    top = max(k for _, _, k in schedule)
    sp = spec.speculative.model_copy(update={"schedule": [tuple(s) for s in schedule],
                                             "num_speculative_tokens": max(top, 1), "adaptive": True})
    return spec.model_copy(update={"speculative": sp})


def resolve_adaptive(spec: DeploymentSpec, run_dir: Path | None,
                     calibrate: Callable[[DeploymentSpec, Path], list[PointResult]],
                     log: Callable[[str], None] = print) -> DeploymentSpec:
    """The schedule for an adaptive ``spec``: tuned from this run, else cached, else from a calibration.
    ``run_dir`` None: no study run (``cartspec serve --adaptive``): the cache, else a calibration."""
    sp = spec.speculative
    if not sp.adaptive or sp.schedule:
        return spec
    results = load_results(run_dir) if run_dir is not None else []
    for r in reversed(results):  # a resumed run keeps the schedule its first points were measured with
        was = measured_spec(r.config)
        if r.config.deployment == spec.label and was and was.speculative.adaptive and was.speculative.schedule:
            schedule = [tuple(s) for s in was.speculative.schedule]
            log(f"adaptive {sp.label}: schedule {schedule}, as this run's earlier points were measured with")
            return adaptive_spec(spec, schedule)
    key = cache_key(spec)
    cached = tune_dir() / f"{key}.yaml"
    out, why = None, "served without a study run"
    if run_dir is not None:
        try:
            out = tune_from(results, spec)
            source = f"tuned from this run's points ({run_dir})"
        except ValueError as exc:
            why = f"this run cannot tune it ({exc})"
    if out is None:
        if cached.exists():
            tuned = DeploymentSpec.load(cached)
            log(f"adaptive {sp.label}: {why}; schedule {tuned.speculative.schedule} "
                f"(cached for this machine: {cached})")
            return adaptive_spec(spec, tuned.speculative.schedule)
        cal_dir = tune_dir() / f"calibrate-{key}"
        log(f"adaptive {sp.label}: {why}; calibrating into {cal_dir}")
        out = tune_from(calibrate(spec, cal_dir), spec)
        source = f"tuned from a calibration ({cal_dir})"
    out.save(cached)
    log(f"adaptive {sp.label}: schedule {out.speculative.schedule}, {source}; cached at {cached}")
    return out


# How many interleaved runs (this one included) the cached schedule is tuned from.
POOL_RUNS = 3


def refresh_cache(spec: DeploymentSpec, run_dir: Path, log: Callable[[str], None] = print) -> DeploymentSpec | None:
    """After an interleaved study, whose adaptive row had to run a schedule tuned before it: tune again from
    this run's fixed-γ points (measured side by side, so free of the host's drift between deployments),
    pooled with those of the last runs that refreshed this cache entry, and cache that, so ``serve
    --adaptive`` and the next study run it. None when this run's points cannot tune."""
    import json

    key = cache_key(spec)
    history = tune_dir() / f"{key}.runs.json"
    here = Path(run_dir).resolve()
    mine = load_results(here)
    try:
        out = tune_from(mine, spec)  # this run's own points must be able to tune; the schedule it ran is not read
    except ValueError:
        return None
    earlier = json.loads(history.read_text()).get("runs", []) if history.exists() else []
    runs = [Path(r) for r in earlier if Path(r) != here and (Path(r) / "results.jsonl").exists()]
    runs = runs[-(POOL_RUNS - 1):] if POOL_RUNS > 1 else []
    if runs:
        try:
            out = tune_from([load_results(r) for r in runs] + [mine], spec)
        except ValueError:
            runs = []
    runs.append(here)
    cached = tune_dir() / f"{key}.yaml"
    out.save(cached)
    history.write_text(json.dumps({"runs": [str(r) for r in runs]}, indent=1))
    ran = spec.speculative.schedule
    same = [tuple(s) for s in ran or []] == [tuple(s) for s in out.speculative.schedule]
    pooled = f", pooled with {len(runs) - 1} earlier run(s): {', '.join(str(r) for r in runs[:-1])}" \
        if len(runs) > 1 else ""
    log(f"adaptive {spec.speculative.label}: this run's points{pooled} tune {out.speculative.schedule}"
        + (" (the schedule it ran)" if same else f" (it ran {ran}); the next study and `serve --adaptive` "
           "run the new one") + f"; cached at {cached}")
    return out
