"""`cartspec tune`: γ per batch size where the measurements and the cost model say it is fastest."""

from __future__ import annotations

import pytest
from synthetic_sweep import CPU_LIKE, StepCosts, point, sweep, write_run
from typer.testing import CliRunner

from cartspec.analysis.tune import TuneResult, merge_schedule, tune_json_path, tune_schedule
from cartspec.cli import app
from cartspec.serving.spec import DeploymentSpec

# Speculation pays while the step's fixed cost dominates (b <= 4) and loses once drafting for every
# sequence costs more than the accepted tokens save (b >= 5).
WINS_SMALL = StepCosts(alpha=0.02, beta=0.002, delta=0.0005, epsilon=0.004, pi=0.0004)
HIGH_ACCEPT = {0.0: [0.98, 0.97, 0.96], 0.5: [0.95, 0.93, 0.9]}
# A step's fixed cost large enough that five drafted tokens pay at one stream.
OVERHEAD_BOUND = StepCosts(alpha=0.03, beta=0.002, delta=0.001, epsilon=0.001, pi=0.0004)
LONG_ACCEPT = {0.0: [0.95, 0.9, 0.85, 0.8, 0.75], 0.5: [0.85, 0.75, 0.65, 0.55, 0.45]}
# Drafting dearer than verifying: a head that never pays.
DRAFT_BOUND = StepCosts(alpha=0.005, beta=0.002, delta=0.01, epsilon=0.01, pi=0.0004)


def wins_small_run(**kw):
    return sweep(WINS_SMALL, deployments=(("none", 0), ("eagle3", 3)), accept=HIGH_ACCEPT, **kw)


def test_schedule_speculates_where_it_pays_and_turns_off_under_load():
    res = tune_schedule(wins_small_run())
    assert res.schedule == [(1, 4, 3), (5, 64, 0)]
    assert res.head == "domain" and res.gammas == [0, 1, 2, 3] and res.temperatures == [0.0, 0.5]
    by = {c.batch: c for c in res.choices}
    assert [by[b].reason for b in (1, 2, 3, 4, 8, 12)] == ["measured", "measured", "model", "measured", "measured",
                                                           "model"]
    assert by[1].speedup[3] > by[4].speedup[3] > 1 > by[5].speedup[3]
    assert by[1].source[3] == "measured" and by[1].source[2] == "model"
    assert any("acceptance beyond position 3 was never measured" in n for n in res.notes)
    spec = res.deployment()
    assert spec.speculative.method == "eagle3" and spec.speculative.num_speculative_tokens == 3
    assert spec.speculative.vllm_config("/heads/domain")["num_speculative_tokens_per_batch_size"] == [[1, 4, 3],
                                                                                                      [5, 64, 0]]


def test_the_longest_gamma_wins_at_one_stream_and_gamma_falls_as_the_batch_grows():
    res = tune_schedule(sweep(OVERHEAD_BOUND, accept=LONG_ACCEPT))
    ks = [k for *_, k in res.schedule]
    assert res.schedule[0][:1] == (1,) and ks[0] == 5 and ks[-1] == 0
    assert ks == sorted(ks, reverse=True) and len(set(ks)) == len(ks)
    assert res.schedule[0][1] >= 2 and res.schedule[-1][0] <= 32  # γ=5 beyond one stream, off before 32


def test_a_measured_ratio_overrides_the_model_at_its_own_concurrency():
    """At 4 streams the head measured 0.8x of what the model predicts (below the baseline there): the
    measurement decides at 4."""
    results = [point(WINS_SMALL, r.config.method, r.config.gamma or 0, r.config.concurrency, r.config.temperature,
                     accept=HIGH_ACCEPT, noise=0.8 if (r.config.method, r.config.concurrency) == ("eagle3", 4) else 1.0)
               for r in wins_small_run()]
    res = tune_schedule(results)
    by = {c.batch: c for c in res.choices}
    assert by[4].reason == "measured" and by[4].source[3] == "measured" and by[4].speedup[3] < 1
    assert by[4].k == 2 and by[3].k == 3  # γ=3 measured slower there; the model's γ=2 still pays
    assert res.schedule == [(1, 3, 3), (4, 4, 2), (5, 64, 0)]


def test_gamma_never_rises_with_the_batch_even_where_one_point_measured_faster():
    """At 8 streams one noisy point measured the head 1.5x faster than the model says: a larger γ at a
    larger batch than its neighbours is noise, so the schedule caps it at the smaller batch's γ and says so."""
    results = [point(WINS_SMALL, r.config.method, r.config.gamma or 0, r.config.concurrency, r.config.temperature,
                     accept=HIGH_ACCEPT, noise=1.5 if (r.config.method, r.config.concurrency) == ("eagle3", 8) else 1.0)
               for r in wins_small_run()]
    res = tune_schedule(results)
    by = {c.batch: c for c in res.choices}
    assert by[8].speedup[3] > 1.1 and by[8].k == by[7].k == 0
    ks = [c.k for c in res.choices]
    assert ks == sorted(ks, reverse=True) and ks[0] == 3
    assert any(n.startswith("batch 8: γ=3 (measured) capped at γ=0") for n in res.notes)


def test_adjacent_batch_sizes_with_the_same_gamma_merge_into_one_range():
    assert merge_schedule([5, 3, 3, 3, 0, 0, 3]) == [(1, 1, 5), (2, 4, 3), (5, 6, 0), (7, 7, 3)]
    assert merge_schedule([0] * 64) == [(1, 64, 0)]
    res = tune_schedule(wins_small_run(), max_batch=10)
    ranges = res.schedule
    assert ranges[0][0] == 1 and ranges[-1][1] == 10
    assert all(a[1] + 1 == b[0] and a[2] != b[2] for a, b in zip(ranges, ranges[1:]))  # contiguous, merged


def test_when_speculation_never_pays_the_spec_decodes_plainly():
    res = tune_schedule(sweep(DRAFT_BOUND, deployments=(("none", 0), ("eagle3", 3)), accept=HIGH_ACCEPT))
    assert res.schedule == [(1, 64, 0)] and not res.speculates
    assert res.deployment().speculative.method == "none"
    assert any("decodes plainly" in n for n in res.notes)


def test_min_speedup_keeps_marginal_gains_off():
    res = tune_schedule(wins_small_run(), min_speedup=1.2)
    assert res.schedule[0] == (1, 3, 3) and res.schedule[-1][2] == 0  # b=4 gains under 20%: off


def test_the_head_with_most_points_is_tuned_unless_one_is_named():
    results = wins_small_run() + [point(WINS_SMALL, "eagle3", 3, c, 0.0, head="generic", accept=HIGH_ACCEPT)
                                  for c in (1, 8)]
    assert tune_schedule(results).head == "domain"
    assert tune_schedule(results, head="generic").head == "generic"
    with pytest.raises(ValueError, match="no EAGLE-3 points for head 'other'.*domain, generic"):
        tune_schedule(results, head="other")


def test_cartspec_tune_writes_a_spec_that_loads_and_reaches_vllm(tmp_path):
    run = write_run(tmp_path / "run", wins_small_run())
    out = tmp_path / "spec.yaml"
    res = CliRunner().invoke(app, ["tune", "--run", str(run), "--out", str(out)])
    assert res.exit_code == 0, res.output
    spec = DeploymentSpec.load(out)
    assert spec.speculative.method == "eagle3" and spec.speculative.model == "domain"
    assert spec.speculative.schedule == [(1, 4, 3), (5, 64, 0)]
    assert spec.dtype == "float32"  # the engine settings the head was measured with
    assert spec.speculative.vllm_config("/heads/domain")["num_speculative_tokens_per_batch_size"] == [[1, 4, 3],
                                                                                                      [5, 64, 0]]
    tuned = TuneResult.load(tune_json_path(out))
    assert tune_json_path(out).name == "spec.tune.json"
    assert tuned.schedule == [(1, 4, 3), (5, 64, 0)] and tuned.cost_model.n_points == 24
    assert tuned.choices[0].predicted_throughput[3] > tuned.choices[0].predicted_throughput[0]
    for text in ("1–4", "5–64", "0 (off)", "measured at 1,2,4", "leave-one-out"):
        assert text in res.output, text


def test_cartspec_tune_writes_plain_decoding_when_speculation_never_pays(tmp_path):
    run = write_run(tmp_path / "run", sweep(DRAFT_BOUND, deployments=(("none", 0), ("eagle3", 3)),
                                            accept=HIGH_ACCEPT))
    res = CliRunner().invoke(app, ["tune", "--run", str(run)])
    assert res.exit_code == 0, res.output
    assert "method none" in res.output
    spec = DeploymentSpec.load(run / "tuned.yaml")
    assert spec.speculative.method == "none" and spec.speculative.vllm_config() is None


def test_cartspec_tune_says_which_command_to_run(tmp_path):
    res = CliRunner().invoke(app, ["tune", "--run", str(tmp_path / "nothing")])
    assert res.exit_code == 2 and "no results.jsonl" in res.output and "cartspec study" in res.output
    run = write_run(tmp_path / "baseline", sweep(deployments=(("none", 0),)))
    res = CliRunner().invoke(app, ["tune", "--run", str(run)])
    assert res.exit_code == 2 and "cartspec study --preset calibrate" in res.output
    run = write_run(tmp_path / "domain", wins_small_run())
    res = CliRunner().invoke(app, ["tune", "--run", str(run), "--head", "generic"])
    assert res.exit_code == 2 and "no EAGLE-3 points for head 'generic'" in res.output


def test_a_gamma_only_the_model_speaks_for_must_beat_a_measured_one_by_more_than_the_models_error():
    """At 2 streams γ=5 measured 3% under what the model says, so the model's γ=4 (never measured) looks
    faster. Within the model's error that is noise: the measured γ=5 is kept, and with it γ=5 at the
    batch sizes after (γ never rises with load, so a γ=4 at 2 would have capped them all)."""
    results = [point(OVERHEAD_BOUND, r.config.method, r.config.gamma or 0, r.config.concurrency,
                     r.config.temperature, accept=LONG_ACCEPT,
                     noise=0.97 if (r.config.gamma, r.config.concurrency) == (5, 2) else 1.0)
               for r in sweep(OVERHEAD_BOUND, accept=LONG_ACCEPT)]
    exact = tune_schedule(results)
    assert exact.cost_model.loo_median_abs_error < 0.01
    # an error-free model: its γ=4 wins at 2, between batch sizes 1 and 4 that both measured γ=5 fastest,
    # which the schedule follows
    assert [c.k for c in exact.choices[:4]] == [5, 5, 5, 5]
    assert any(n.startswith("batch 2: γ=4 (measured) raised to γ=5, the γ of the measured batch 4") for n in exact.notes)
    from cartspec.analysis.cost_model import fit_cost_model
    noisy = fit_cost_model(results).model_copy(update={"loo_median_abs_error": 0.05})
    res = tune_schedule(results, model=noisy)
    by = {c.batch: c for c in res.choices}
    assert by[2].source[4] == "model" and by[2].speedup[4] > by[2].speedup[5]
    assert [by[b].k for b in (1, 2, 3, 4)] == [5, 5, 5, 5]
    assert any(n.startswith("batch 2: measured γ=5") and "within the model's error of 5%" in n for n in res.notes)


def _choice(b, k, anchor, reason="model"):
    from cartspec.analysis.tune import BatchChoice

    return BatchChoice(batch=b, k=k, reason=reason, predicted_throughput={}, speedup={}, source={}, anchor=anchor)


def test_batch_sizes_between_two_measurements_follow_them_not_the_model():
    """Measured γ=3 fastest at 8 and at 16; the model alone prefers γ=2 at 9-15 (and γ=5 at 12). The schedule
    keeps γ=3 from 8 to 16 instead of letting the model's γ=2 cap the measured 16 (as it did on an AVX-512
    CPU, where γ=3 measured 1.06x the γ=2 the schedule ran at 16 streams); γ still never rises with the
    batch, and a measured anchor above an earlier one is capped."""
    from cartspec.analysis.tune import monotone

    ks = {1: 5, 8: 3, 16: 3, 32: 0}
    choices = [_choice(b, ks.get(b, 5 if b == 12 else 2 if b < 32 else 0), anchor=b in ks,
                       reason="measured" if b in ks else "model") for b in range(1, 41)]
    choices[2] = _choice(3, 4, anchor=False)  # the model's γ=4 after a batch size raised to 3: capped
    choices[23] = _choice(24, 5, anchor=True, reason="measured")  # an anchor above the one before it
    notes = monotone(choices)
    assert [c.k for c in choices] == [5] + [3] * 23 + [2] * 7 + [0] * 9
    raised = "(γ never rises with load)"
    assert notes == [
        f"batch 2: γ=2 (model) raised to γ=3, the γ of the measured batch 8 {raised}",
        f"batch 3: γ=4 (model) capped at γ=3, the γ of batch 2 {raised}",
        f"batch 4-7: γ=2 (model) raised to γ=3, the γ of the measured batch 8 {raised}",
        f"batch 9-11: γ=2 (model) raised to γ=3, the γ of the measured batch 16 {raised}",
        f"batch 12: γ=5 (model) capped at γ=3, the γ of batch 11 {raised}",
        f"batch 13-15: γ=2 (model) raised to γ=3, the γ of the measured batch 16 {raised}",
        f"batch 17-23: γ=2 (model) raised to γ=3, the γ of the measured batch 24 {raised}",
        f"batch 24: γ=5 (measured) capped at γ=3, the γ of batch 16 {raised}",
    ]


def _in_rounds(results, concurrency, ratios):
    """The points at ``concurrency`` as if measured in rounds beside each other: the baseline's slices even,
    the head's at ``ratios`` of them."""
    from cartspec.results import PointSlice

    out = []
    for r in results:
        if r.config.concurrency != concurrency:
            out.append(r)
            continue
        head = r.config.method != "none"
        slices = [PointSlice(wall_s=1.0, n_requests=8, output_tokens=int(100 * (x if head else 1))) for x in ratios]
        out.append(r.model_copy(update={"slices": slices, "beside": ["baseline"] if head else [r.config.deployment]}))
    return out


def test_speculation_must_clear_plain_decoding_beyond_the_noise_where_measured_in_rounds():
    """At 4 streams the head measured faster than the baseline. With paired slices that agree it stays on;
    with slices whose interval reaches below 1 (a gain the noise can erase) the schedule decodes plainly
    there: off costs the small gain, on risks falling below the baseline."""
    base = wins_small_run()
    tight = tune_schedule(_in_rounds(base, 4, [1.2, 1.25, 1.22, 1.24]))
    assert {c.batch: c.k for c in tight.choices}[4] == 3
    wide = tune_schedule(_in_rounds(base, 4, [1.9, 0.7, 1.8, 0.75]))
    by = {c.batch: c for c in wide.choices}
    assert by[4].speedup[3] > 1 and by[4].k == 0 and by[3].k == 3
    assert any(n.startswith("batch 4: γ=3 measured") and "95% interval reaches" in n and n.endswith(
        "off (speculation must beat plain decoding beyond the noise)") for n in wide.notes)


def test_several_runs_pool_each_point_beside_its_own_runs_baseline():
    """Two runs of one machine: at 4 streams the first run's slices disagree (an interval reaching below
    plain decoding: off), the second's agree; pooled, eight pairs of slices carry the γ. A run whose host
    ran at half speed at 4 streams, baseline and head alike, measures the same ratio: a point is divided
    by its own run's baseline, never another run's."""
    from cartspec.analysis.tune import measured_speedups

    wide = _in_rounds(wins_small_run(), 4, [1.5, 0.9, 1.45, 0.95])
    tight = _in_rounds(wins_small_run(), 4, [1.3, 1.35, 1.28, 1.32])
    assert {c.batch: c.k for c in tune_schedule(wide).choices}[4] == 0
    pooled = tune_schedule([wide, tight])
    assert {c.batch: c.k for c in pooled.choices}[4] == 3
    assert "measurements of 2 runs pooled, each point beside its own run's baseline" in pooled.notes
    assert pooled.cost_model.n_points == 2 * tune_schedule(wide).cost_model.n_points
    slow = [point(WINS_SMALL, r.config.method, r.config.gamma or 0, r.config.concurrency, r.config.temperature,
                  accept=HIGH_ACCEPT, noise=0.5 if r.config.concurrency == 4 else 1.0) for r in wins_small_run()]
    one = measured_speedups(wins_small_run(), "domain")
    both = measured_speedups([wins_small_run(), slow], "domain")
    assert both[(0.0, 4, 3)] == pytest.approx(one[(0.0, 4, 3)]) and set(both) == set(one)


def test_cartspec_tune_pools_the_runs_it_is_given(tmp_path):
    a = write_run(tmp_path / "a", _in_rounds(wins_small_run(), 4, [1.5, 0.9, 1.45, 0.95]))
    b = write_run(tmp_path / "b", _in_rounds(wins_small_run(), 4, [1.3, 1.35, 1.28, 1.32]))
    res = CliRunner().invoke(app, ["tune", "--run", str(a), "--run", str(b)])
    assert res.exit_code == 0, res.output
    assert DeploymentSpec.load(b / "tuned.yaml").speculative.schedule == [(1, 4, 3), (5, 64, 0)]
    res = CliRunner().invoke(app, ["tune", "--run", str(a), "--run", str(tmp_path / "nothing")])
    assert res.exit_code == 2 and "no results.jsonl in" in res.output


# --- too few points for the cost model: the measured loads decide ---------------------------------------

def _quick_like(jitter=(1.0, 1.02, 0.98, 1.01), jitter_at=None, rounds=True, costs=CPU_LIKE, extra=(), scale=None):
    """What the quick preset measures: the baseline, n-gram, the head at γ=3 and the hybrid (no per-position
    counters) at 1 and 8 streams, T=0, in rounds beside each other: four points the cost model can read.
    Each slice of a drafter is its point's ratio over the baseline times ``jitter`` (``jitter_at``: per load,
    or per (load, γ)). ``extra``: more (method, γ) deployments; ``scale``: (load, γ) -> a factor on that
    point's throughput."""
    from cartspec.results import PointSlice

    out = []
    for m, g in (("none", 0), ("ngram", 3), ("eagle3", 3), ("hybrid", 3), *extra):
        for c in (1, 8):
            r = point(costs, "eagle3" if m == "hybrid" else m, g, c, 0.0, accept=LONG_ACCEPT)
            if (c, g) in (scale or {}):
                r = r.model_copy(update={"output_throughput": r.output_throughput * scale[(c, g)]})
            if m == "hybrid":  # the head's drafts with a lookup: same head, another drafter
                cfg = r.config.model_copy(update={"method": "hybrid", "deployment": "hybrid-domain-g3"})
                r = r.model_copy(update={"acceptance": None, "config": cfg, "key": cfg.key,
                                         "output_throughput": r.output_throughput * 0.5})
            out.append(r)
    base = {r.config.concurrency: r for r in out if r.config.method == "none"}
    if not rounds:
        return out
    rounded = []
    for r in out:
        c = r.config.concurrency
        ratio = r.output_throughput / base[c].output_throughput
        js = (jitter_at or {}).get((c, r.config.gamma), (jitter_at or {}).get(c, jitter))
        slices = [PointSlice(wall_s=1.0, n_requests=2, output_tokens=round(1000 * (ratio * j if r is not base[c] else 1)))
                  for j in js]
        rounded.append(r.model_copy(update={"slices": slices,
                                            "beside": ["baseline"] if r is not base[c] else [r.config.deployment]}))
    return rounded


def test_a_four_point_run_is_tuned_from_its_measured_loads():
    """The quick preset's run: too few points to fit the cost model, so each measured load decides by its own
    interval. The head pays at 1 and 8 streams with intervals above 1: γ=3 up to 8, plain decoding above
    (nothing measured there), and the result says it was decided without the model."""
    results = _quick_like()
    with pytest.raises(ValueError, match="five points or more"):
        tune_schedule(results)
    res = tune_schedule(results, fallback=True)
    assert res.basis == "measured" and res.cost_model is None and res.method == "eagle3"
    assert res.schedule == [(1, 8, 3), (9, 64, 0)] and res.gammas == [0, 3]
    by = {c.batch: c for c in res.choices}
    assert by[1].anchor and by[8].anchor and not by[4].anchor and by[4].load == 8 and by[9].reason == "unmeasured"
    assert by[1].speedup[3] > by[8].speedup[3] > 1 and by[8].interval[3][0] > 1
    assert res.notes[0].startswith("decided from the measured points: the cost model cannot be fitted (")
    assert any("batch sizes above 8" in n and "decode plainly" in n for n in res.notes)
    # the hybrid drafts with the same head at the same γ, at half the head's speed: not mixed in
    from cartspec.analysis.tune import measured_speedups

    assert measured_speedups(results, "domain", "eagle3")[(0.0, 8, 3)] == pytest.approx(by[8].speedup[3])


def test_a_load_whose_interval_reaches_plain_decoding_decodes_plainly():
    """At 8 streams the head measured faster, but its paired slices disagree (an interval reaching below 1):
    γ=0 from 2 to 8, γ=3 at 1 only. A run not measured in rounds has no interval at all: plain decoding
    everywhere, and the notes say why."""
    wide = tune_schedule(_quick_like(jitter_at={8: (1.6, 0.5, 1.5, 0.55)}), fallback=True)
    assert wide.schedule == [(1, 1, 3), (2, 64, 0)]
    assert any(n.startswith("load 8: γ=3 measured") and "95% interval reaches" in n for n in wide.notes)
    slower = tune_schedule(_quick_like(costs=WINS_SMALL), fallback=True)  # measured slower at 8 streams
    assert slower.schedule == [(1, 1, 3), (2, 64, 0)] and {c.batch: c for c in slower.choices}[8].speedup[3] < 1
    alone = tune_schedule(_quick_like(rounds=False), fallback=True)
    assert alone.schedule == [(1, 64, 0)] and not alone.speculates
    assert any("with no interval (not measured in rounds" in n for n in alone.notes)
    assert any("decodes plainly (method none)" in n for n in alone.notes)


def test_gamma_decided_from_measured_loads_never_rises_with_load():
    """γ=5 measured too: at 1 stream its slices disagree (γ=3 wins there), at 8 it is reliably the fastest;
    γ=5 at 8 is capped at the γ=3 of 1 stream. Without the baseline beside the head, nothing can be decided."""
    from cartspec.analysis.tune import measured_schedule

    results = _quick_like(extra=(("eagle3", 5),), jitter_at={(1, 5): (1.6, 0.5, 1.5, 0.55)}, scale={(8, 5): 1.1})
    res = measured_schedule(results)
    by = {c.batch: c for c in res.choices}
    assert by[8].speedup[5] > by[8].speedup[3] and by[8].interval[5][0] > 1
    assert res.schedule == [(1, 8, 3), (9, 64, 0)] and res.gammas == [0, 3, 5]
    assert "load 8: γ=5 capped at γ=3, the γ of a smaller load (γ never rises with load)" in res.notes
    with pytest.raises(ValueError, match="measured beside the baseline"):
        measured_schedule([r for r in results if r.config.method != "none"], head="domain")


def test_cartspec_tune_on_a_four_point_run_writes_a_schedule_serve_runs(tmp_path):
    run = write_run(tmp_path / "quick", _quick_like())
    res = CliRunner().invoke(app, ["tune", "--run", str(run)])
    assert res.exit_code == 0, res.output
    for text in ("decided from the measured points", "1–8", "9–64", "95% ", "measured at 1,8",
                 "not measured: plain decoding"):
        assert text in res.output, text
    spec = DeploymentSpec.load(run / "tuned.yaml")  # what `cartspec serve --spec` and `cartspec export` read
    assert spec.speculative.method == "eagle3" and spec.speculative.model == "domain"
    assert spec.speculative.schedule == [(1, 8, 3), (9, 64, 0)] and spec.speculative.num_speculative_tokens == 3
    assert spec.speculative.vllm_config("/heads/domain")["num_speculative_tokens_per_batch_size"] == [[1, 8, 3],
                                                                                                      [9, 64, 0]]
    tuned = TuneResult.load(tune_json_path(run / "tuned.yaml"))
    assert tuned.basis == "measured" and tuned.cost_model is None and tuned.schedule == [(1, 8, 3), (9, 64, 0)]
