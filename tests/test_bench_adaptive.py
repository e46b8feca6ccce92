"""An adaptive deployment (``eagle3:HEAD:auto``) gets the schedule tuned for this machine: from the
run's own points, else from the cache, else from a calibration; a study that cannot tune it records
why and goes on."""

from __future__ import annotations

import pytest

from cartspec.bench import adaptive
from cartspec.bench.plan import parse_deployment, preset
from cartspec.results import load_results
from synthetic_sweep import sweep, write_run


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    # the key names this machine, model and head; no real model is resolved in a unit test
    monkeypatch.setattr(adaptive, "cache_key", lambda spec: f"k-{spec.speculative.model}-{spec.dtype}")
    return tmp_path / "home"


def _calibrate_never(spec, out):
    raise AssertionError("calibration should not run")


def test_auto_label_reads_as_an_adaptive_eagle3_deployment():
    spec = parse_deployment("eagle3:domain:auto", "commerce")
    assert spec.speculative.adaptive and spec.speculative.model == "domain"
    assert spec.label == "eagle3-domain-auto"
    assert spec.label in {d.label for d in preset("paper").deployments}


def test_the_runs_own_points_tune_it_and_the_schedule_is_cached(home, tmp_path):
    run = write_run(tmp_path / "run", sweep())
    spec = parse_deployment("eagle3:domain:auto", "commerce").model_copy(update={"dtype": "float32"})
    tuned = adaptive.resolve_adaptive(spec, run, _calibrate_never, log=lambda m: None)
    sched = tuned.speculative.schedule
    assert sched[0][0] == 1 and sched[-1][1] == spec.max_num_seqs
    assert tuned.speculative.num_speculative_tokens == max(max(k for *_, k in sched), 1)
    assert tuned.label == "eagle3-domain-auto"  # still the adaptive row in the report
    # The synthetic CPU-like machine: speculation pays at one stream, not at 32.
    assert tuned.speculative.gamma_at(1) > 0 and tuned.speculative.gamma_at(32) == 0
    # A second study (no points of its own) reuses the cache: same schedule, no calibration.
    again = adaptive.resolve_adaptive(spec, tmp_path / "empty-run", _calibrate_never, log=lambda m: None)
    assert again.speculative.schedule == sched


def test_the_runs_own_points_win_over_an_older_cached_schedule(home, tmp_path):
    spec = parse_deployment("eagle3:domain:auto", "commerce").model_copy(update={"dtype": "float32"})
    stale = adaptive.adaptive_spec(spec, [(1, 64, 1)])
    stale.save(adaptive.tune_dir() / f"{adaptive.cache_key(spec)}.yaml")
    run = write_run(tmp_path / "run", sweep())
    tuned = adaptive.resolve_adaptive(spec, run, _calibrate_never, log=lambda m: None)
    assert tuned.speculative.schedule != [(1, 64, 1)] and tuned.speculative.gamma_at(32) == 0
    # and the cache now holds this run's schedule
    again = adaptive.resolve_adaptive(spec, tmp_path / "empty-run", _calibrate_never, log=lambda m: None)
    assert again.speculative.schedule == tuned.speculative.schedule


def test_a_resumed_run_keeps_the_schedule_its_adaptive_points_were_measured_with(home, tmp_path):
    from cartspec.bench.plan import SweepPlan
    from cartspec.results import PointResult, append_result

    spec = parse_deployment("eagle3:domain:auto", "commerce").model_copy(update={"dtype": "float32"})
    first = adaptive.adaptive_spec(spec, [(1, 3, 2), (4, 64, 0)])  # what the first invocation ran
    run = write_run(tmp_path / "run", sweep())  # points that alone would tune another schedule
    cfg = SweepPlan(deployments=[first]).points(first)[0]
    append_result(run, PointResult.failed(cfg, "killed mid-run"))
    tuned = adaptive.resolve_adaptive(spec, run, _calibrate_never, log=lambda m: None)
    assert tuned.speculative.schedule == [(1, 3, 2), (4, 64, 0)]
    assert tuned.label == cfg.deployment  # the same row: its points' keys still match


def test_an_interleaved_runs_own_points_become_the_cached_schedule_for_the_next_run(home, tmp_path):
    spec = parse_deployment("eagle3:domain:auto", "commerce").model_copy(update={"dtype": "float32"})
    ran = adaptive.adaptive_spec(spec, [(1, 64, 1)])  # tuned before the run, from older measurements
    msgs = []
    assert adaptive.refresh_cache(ran, tmp_path / "empty-run", log=msgs.append) is None  # nothing to tune from
    run = write_run(tmp_path / "run", sweep())
    new = adaptive.refresh_cache(ran, run, log=msgs.append)
    assert new is not None and new.speculative.gamma_at(32) == 0 and new.speculative.schedule != [(1, 64, 1)]
    assert "it ran [(1, 64, 1)]" in msgs[-1]
    again = adaptive.resolve_adaptive(spec, tmp_path / "next-run", _calibrate_never, log=lambda m: None)
    assert again.speculative.schedule == new.speculative.schedule


def test_without_points_it_calibrates_first(home, tmp_path):
    calls = []

    def calibrate(spec, out):
        calls.append(out)
        return sweep(concurrencies=(1, 4, 16), temperatures=(0.0,), deployments=(("none", 0), ("eagle3", 5)))

    spec = parse_deployment("eagle3:domain:auto", "commerce").model_copy(update={"dtype": "float32"})
    tuned = adaptive.resolve_adaptive(spec, tmp_path / "empty-run", calibrate, log=lambda m: None)
    assert len(calls) == 1 and "calibrate" in calls[0].name
    assert tuned.speculative.schedule and tuned.speculative.gamma_at(1) > 0


def test_an_adaptive_deployment_that_cannot_be_tuned_is_recorded_failed(home, tmp_path, monkeypatch):
    import cartspec.bench.sweep as sweep_mod
    from cartspec.bench.sweep import SweepPlan, run_sweep

    def calibrate_fails(spec, out):
        raise RuntimeError("calibration deployment did not start: no head")

    plan = SweepPlan(deployments=[parse_deployment("eagle3:domain:auto", "commerce")], concurrencies=[1, 4],
                     n_requests=2)
    monkeypatch.setattr(sweep_mod, "_tuned", lambda plan, spec, out, launcher, reporter: adaptive.resolve_adaptive(
        spec, out, calibrate_fails, log=lambda m: None))
    results = run_sweep(plan, tmp_path / "run")
    assert len(results) == 2 and all(r.status == "failed" for r in results)
    assert all("adaptive schedule could not be tuned" in r.reason and "no head" in r.reason for r in results)
    assert len(load_results(tmp_path / "run")) == 2


def test_calibrate_preset_measures_what_the_cost_model_needs():
    plan = preset("calibrate")
    assert [d.label for d in plan.deployments] == ["baseline", "eagle3-domain-g5"]
    assert plan.concurrencies == [1, 4, 16]
    assert len(plan.all_points()) == 6


def test_serve_adaptive_uses_the_schedule_tuned_for_this_machine(home, tmp_path):
    from cartspec.agent.cli import adaptive_schedule
    from cartspec.agent.defaults import adaptive_request, default_spec

    run = write_run(tmp_path / "run", sweep())
    spec = parse_deployment("eagle3:domain:auto", "commerce").model_copy(update={"dtype": "float32"})
    tuned = adaptive.resolve_adaptive(spec, run, _calibrate_never, log=lambda m: None)  # a study cached it
    served = adaptive_schedule(adaptive_request(default_spec("commerce", "domain", 3, False, "float32", "eagle3")
                                                .model_copy(update={"max_num_seqs": spec.max_num_seqs})))
    assert served.speculative.schedule == tuned.speculative.schedule
    assert served.speculative.vllm_config("/h")["num_speculative_tokens_per_batch_size"]


def test_the_cached_schedule_pools_the_last_runs_that_refreshed_it(home, tmp_path):
    """Each interleaved run re-tunes the cache from its own points and those of the runs before it (up to
    POOL_RUNS, the ones still on disk): the log names them; a run whose points cannot tune changes nothing."""
    spec = parse_deployment("eagle3:domain:auto", "commerce").model_copy(update={"dtype": "float32"})
    ran = adaptive.adaptive_spec(spec, [(1, 64, 1)])
    msgs = []
    runs = [write_run(tmp_path / f"run{i}", sweep()) for i in range(4)]
    for r in runs:
        adaptive.refresh_cache(ran, r, log=msgs.append)
    assert "pooled" not in msgs[0]
    assert f"pooled with 1 earlier run(s): {runs[0].resolve()}" in msgs[1]
    assert f"pooled with 2 earlier run(s): {runs[1].resolve()}, {runs[2].resolve()}" in msgs[3]  # run0 aged out
    import shutil

    shutil.rmtree(runs[2])  # a deleted run drops out of the pool
    adaptive.refresh_cache(ran, runs[3], log=msgs.append)  # the same run again counts once
    assert f"pooled with 1 earlier run(s): {runs[1].resolve()} tune" in msgs[-1]
    assert adaptive.refresh_cache(ran, tmp_path / "empty-run", log=msgs.append) is None
    assert len(msgs) == 5
