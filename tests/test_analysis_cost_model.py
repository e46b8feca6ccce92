"""The cost model: fitted from a sweep, it gives back the machine's step costs and predicts throughput."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from synthetic_sweep import ACCEPT, CPU_LIKE, lengths, point, sweep, true_throughput, write_run

from cartspec.analysis.cost_model import (CostModel, StepCosts, acceptance_for, fit_cost_model, leave_one_out,
                                          median_abs_error, nnls)
from cartspec.results import PointResult


def _close(fitted: StepCosts, true: StepCosts, rel: float) -> None:
    for name, want in true.model_dump().items():
        assert getattr(fitted, name) == pytest.approx(want, rel=rel), name


def test_fit_recovers_the_machines_step_costs_and_predicts_within_one_percent():
    model = fit_cost_model(sweep())
    _close(model.coefficients, CPU_LIKE, 0.01)
    assert model.n_points == 36 and model.median_abs_error < 0.01 and model.loo_median_abs_error < 0.01
    # a configuration never measured: γ=4 at 12 streams
    prompt, out = lengths(12, 0.0)
    want = true_throughput(CPU_LIKE, 12, 4, ACCEPT[0.0], prompt, out)
    assert model.predict_throughput(12, 4, ACCEPT[0.0], prompt, out) == pytest.approx(want, rel=0.01)
    assert "Synthetic CPU" in model.machine and "float32" in model.machine


def test_the_calibrate_grid_alone_pins_the_costs_down():
    """The baseline and one head at γ=5 at three loads, greedy only: what `--preset calibrate` measures."""
    model = fit_cost_model(sweep(deployments=(("none", 0), ("eagle3", 5)), concurrencies=(1, 4, 16),
                                 temperatures=(0.0,)))
    _close(model.coefficients, CPU_LIKE, 0.01)
    prompt, out = lengths(8, 0.0)  # γ=3 at 8 streams: neither measured
    assert model.predict_throughput(8, 3, ACCEPT[0.0], prompt, out) == pytest.approx(
        true_throughput(CPU_LIKE, 8, 3, ACCEPT[0.0], prompt, out), rel=0.01)


def test_the_batch_is_what_was_in_flight_not_the_nominal_concurrency():
    """A closed loop drains at its end, more so at high concurrency: the engine ran smaller batches."""
    results = [point(CPU_LIKE, m, g, c, t, in_flight_share=1 - 0.08 * math.log2(c))
               for m, g in (("none", 0), ("eagle3", 3), ("eagle3", 5)) for t in (0.0, 0.5)
               for c in (1, 2, 4, 8, 16, 32)]
    model = fit_cost_model(results)
    _close(model.coefficients, CPU_LIKE, 0.01)
    by = {(p.deployment, p.concurrency, p.temperature): p for p in model.evaluate(results)}
    assert by[("baseline", 32, 0.0)].batch == pytest.approx(32 * 0.6)
    assert max(abs(p.error) for p in by.values()) < 0.01


def test_leave_one_out_error_is_reported_and_is_not_flattering():
    results = sweep(noise=0.05, seed=3)
    model = fit_cost_model(results)
    loo = leave_one_out(results)
    assert len(loo) == model.n_points
    assert model.loo_median_abs_error == pytest.approx(median_abs_error(loo))
    assert model.median_abs_error <= model.loo_median_abs_error < 0.10
    assert model.median_abs_error > 0.005  # the noise shows: the fit does not pretend to be exact


def test_cost_model_round_trips_through_json(tmp_path):
    model = fit_cost_model(sweep(noise=0.02))
    path = model.save(tmp_path / "cost.json")
    back = CostModel.load(path)
    assert back == model
    assert json.loads(path.read_text())["coefficients"]["alpha"] == model.coefficients.alpha
    assert back.predict_throughput(3, 2, [0.7, 0.6], 140, 60) == model.predict_throughput(3, 2, [0.7, 0.6], 140, 60)


@pytest.mark.parametrize("results", [
    [],
    sweep(deployments=(("none", 0),)),  # no speculative point
    sweep(deployments=(("none", 0), ("eagle3", 3)), concurrencies=(4,)),  # one concurrency
    sweep(deployments=(("eagle3", 3),)),  # no baseline
    [point(CPU_LIKE, "eagle3", 3, 1, 0.0)],  # one point
], ids=["empty", "baseline-only", "one-concurrency", "no-baseline", "one-point"])
def test_a_sweep_that_cannot_pin_the_costs_says_what_to_measure(results):
    with pytest.raises(ValueError, match=r"baseline and speculative .* two or more concurrencies.*"
                                         r"cartspec study --preset calibrate"):
        fit_cost_model(results)


def test_points_outside_the_model_do_not_spoil_the_fit():
    """n-gram, failed, open-loop and scheduled points describe something else; they are left out."""
    results = sweep()
    ngram = point(CPU_LIKE, "ngram", 3, 4, 0.0, noise=0.3)
    failed = PointResult.failed(results[0].config.model_copy(update={"concurrency": 3}), "died")
    open_loop = point(CPU_LIKE, "none", 0, 2, 0.0, noise=2.0)
    open_loop.config = open_loop.config.model_copy(update={"mode": "open", "rate": 1.0, "concurrency": None})
    scheduled = point(CPU_LIKE, "eagle3", 5, 8, 0.0, noise=0.5)
    scheduled.config.spec["speculative"]["schedule"] = [[1, 4, 5], [5, 64, 0]]
    model = fit_cost_model(results + [ngram, failed, open_loop, scheduled])
    assert model.n_points == len(results)
    _close(model.coefficients, CPU_LIKE, 0.01)


def test_nnls_is_non_negative_and_optimal():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(30, 5))
    y = a @ np.array([1.0, -2.0, 0.5, 0.0, 3.0]) + rng.normal(scale=0.1, size=30)
    x = nnls(a, y)
    grad = a.T @ (a @ x - y)
    assert np.all(x >= 0) and x[1] == 0  # the negative coefficient is clamped...
    assert np.all(np.abs(grad[x > 0]) < 1e-8) and np.all(grad[x == 0] > -1e-8)  # ...and the rest is the optimum (KKT)


def test_acceptance_at_an_unmeasured_gamma_comes_from_the_largest_gamma_at_the_nearest_load():
    def acc(p):
        return {0.0: p}

    results = [point(CPU_LIKE, "eagle3", 3, 4, 0.0, accept=acc([0.9, 0.9, 0.9])),
               point(CPU_LIKE, "eagle3", 5, 1, 0.0, accept=acc([0.8, 0.7, 0.6, 0.5, 0.4])),
               point(CPU_LIKE, "eagle3", 5, 16, 0.0, accept=acc([0.6, 0.5, 0.4, 0.3, 0.2]))]
    assert acceptance_for(results, "domain", 0.0, 2, 2) == pytest.approx([0.8, 0.7])  # γ=5 at c=1, not γ=3 at c=4
    assert acceptance_for(results, "domain", 0.0, 4, 12) == pytest.approx([0.6, 0.5, 0.4, 0.3])
    with pytest.raises(ValueError, match="measured up to position 5"):
        acceptance_for(results, "domain", 0.0, 6, 1)
    with pytest.raises(ValueError, match="no acceptance"):
        acceptance_for(results, "generic", 0.0, 2, 1)


def test_report_shows_predicted_against_measured_and_says_why_when_it_cannot(tmp_path):
    from cartspec.report.build import build_report

    rep = build_report(write_run(tmp_path / "full", sweep(noise=0.03)))
    cost = json.loads(rep.summary.read_text())["cost_model"]
    assert cost["fitted"] and cost["median_abs_error"] < 0.05 and cost["loo_median_abs_error"] < 0.05
    assert set(cost["coefficients"]) == {"alpha", "beta", "delta", "epsilon", "pi"}
    assert len(cost["points"]) == 36
    assert {"deployment", "concurrency", "temperature", "measured", "predicted", "error"} <= cost["points"][0].keys()
    html = rep.html.read_text()
    assert 'id="cost-model"' in html and 'id="fig-cost-model"' in html and "leave-one-out" in html

    rep = build_report(write_run(tmp_path / "baseline-only", sweep(deployments=(("none", 0),))))
    cost = json.loads(rep.summary.read_text())["cost_model"]
    assert cost == {"fitted": False, "reason": cost["reason"]} and "calibrate" in cost["reason"]
    html = rep.html.read_text()
    assert "Not fitted: the cost model needs" in html and 'id="fig-cost-model"' not in html
    assert 'id="points"' in html and 'id="capacity"' in html  # the rest of the report is untouched
