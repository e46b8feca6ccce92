"""The study's analysis layer against a results file written before it existed.

``tests/data/study_v1`` holds a cut-down paper run (``make_fixture.py``) as the version before the typed
analysis wrote it, and ``summary.before.json``: the summary that version's report built from it. One
deliberate change since: the agreement rows' interval, p-value and verdict (``quality_tests``) are the
quality step's paired equivalence test, whose interval stays about ±3/n wide when no pair differs (it
was [0, 0], and "preserved" meant only "not worse"); those fields were updated in the fixture.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "study_v1"


def _missing_or_changed(before, after, path="") -> list[str]:
    """Every key of ``before`` must be in ``after`` with the same value (new keys may be added)."""
    if isinstance(before, dict):
        if not isinstance(after, dict):
            return [f"{path}: {type(after).__name__} instead of an object"]
        out = []
        for k, v in before.items():
            if k not in after:
                out.append(f"{path}.{k}: missing")
            else:
                out.extend(_missing_or_changed(v, after[k], f"{path}.{k}"))
        return out
    if isinstance(before, list):
        if not isinstance(after, list) or len(after) != len(before):
            return [f"{path}: {len(before)} items before, {after if not isinstance(after, list) else len(after)} now"]
        return [d for i, (a, b) in enumerate(zip(before, after)) for d in _missing_or_changed(a, b, f"{path}[{i}]")]
    if isinstance(before, float) and isinstance(after, (int, float)) and not isinstance(after, bool):
        # the same figure to 9 digits: least-squares fits round differently on other CPUs' BLAS kernels
        # (AVX-512 and AVX2 machines differ in the 16th digit of the cost model's coefficients)
        return [] if math.isclose(before, after, rel_tol=1e-9, abs_tol=1e-12) else [
            f"{path}: {before!r} before, {after!r} now"]
    return [] if before == after else [f"{path}: {before!r} before, {after!r} now"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """The fixture run, copied (the report writes beside the results), reported once."""
    from cartspec.report.build import build_report

    d = tmp_path_factory.mktemp("study_v1")
    for name in ("results.jsonl", "run.json", "quality.json"):
        shutil.copy(DATA / name, d / name)
    build_report(d)
    return d


def test_summary_figures_are_those_of_the_version_before(run_dir):
    before = json.loads((DATA / "summary.before.json").read_text())
    after = json.loads((run_dir / "summary.json").read_text())
    before["run"].pop("dir"), after["run"].pop("dir")  # where the copy was reported
    assert _missing_or_changed(before, after) == []


def _golden_form(text: str, run_dir: Path) -> str:
    """A page or summary as ``golden/`` stores it: the run's directory as ``RUN_DIR``, and each inline PNG as
    the SHA-256 of its bytes (the same pictures, a fiftieth of the size)."""
    text = text.replace(str(run_dir), "RUN_DIR")
    return re.sub(r"data:image/png;base64,([A-Za-z0-9+/=]+)",
                  lambda m: "data:image/png;sha256," + hashlib.sha256(base64.b64decode(m.group(1))).hexdigest(),
                  text)


# The one change the refactor made on purpose: the report shows one quality verdict table. Where
# `cartspec quality` ran, its table replaces the earlier agreement table, and the sentence pointing at that
# table goes with it. Cut from the page before, these leave it byte for byte the page now.
DROPPED_FROM_GOLDEN = (
    re.compile(r"<h2>Quality: speculative replies against the baseline's</h2>.*?</table>", re.S),
    re.compile(r" \(The table above is the earlier one-sided check of exact match: .*?−margin\.\)", re.S),
)


FLOAT = re.compile(r"-?\d+\.\d+(?:e-?\d+)?")


def _floats_rounded(obj):
    """``obj`` (parsed JSON) with every float to 12 significant digits."""
    if isinstance(obj, float):
        return float(f"{obj:.12g}")
    if isinstance(obj, list):
        return [_floats_rounded(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _floats_rounded(v) for k, v in obj.items()}
    return obj


def test_summary_and_report_are_byte_identical_to_the_golden_run(run_dir):
    """``golden/`` holds summary.json and report.html as the code before the typed results-to-report path
    (issue 32) built them from this fixture. The refactor moves code: the summary is the same to the byte
    but for a float's last digits (to 12 significant digits),
    and so is the page, less the table it drops on purpose (``DROPPED_FROM_GOLDEN``). Two changes since were
    made on purpose and written into both files: the verdict's sentence on greedy parity per dtype and load,
    and the adaptive table's rows naming a draft cut per request (``draft_stop``, null for a schedule) under
    the heading "Adaptive drafting"."""
    after = _golden_form((run_dir / "summary.json").read_text(), run_dir)
    golden = (DATA / "golden" / "summary.json").read_text()
    # the cost model's least-squares fit differs in a float's last digits between CPUs (numpy's BLAS takes
    # AVX2 or AVX-512 kernels): floats are compared to 12 significant digits, everything else to the byte
    assert _floats_rounded(json.loads(after)) == _floats_rounded(json.loads(golden))
    assert re.sub(FLOAT, "F", after) == re.sub(FLOAT, "F", golden)
    before = (DATA / "golden" / "report.html").read_text()
    for cut in DROPPED_FROM_GOLDEN:
        before, n = cut.subn("", before)
        assert n == 1, cut.pattern
    assert _golden_form((run_dir / "report.html").read_text(), run_dir) == before


def test_summary_json_is_the_analysis_and_loads_back(run_dir):
    from cartspec.analysis.models import StudyAnalysis

    text = (run_dir / "summary.json").read_text()
    loaded = StudyAnalysis.model_validate_json(text)
    assert loaded.model_dump(mode="json") == json.loads(text)
    assert StudyAnalysis.model_validate_json(loaded.model_dump_json()) == loaded
    assert StudyAnalysis.load(run_dir) == loaded


def test_typed_rows_carry_load_and_speedup(run_dir):
    from cartspec.analysis.models import StudyAnalysis

    a = StudyAnalysis.load(run_dir)
    by = {(r.deployment, r.load, r.temperature): r for r in a.points}
    g3, base = by[("eagle3-domain-g3", "c=8", 0.0)], by[("baseline", "c=8", 0.0)]
    assert g3.load_value == 8.0 and g3.speedup == pytest.approx(g3.output_throughput / base.output_throughput)
    assert base.speedup == 1.0 and by[("eagle3-domain-g5", "c=1", 0.0)].status == "failed"
    assert {c.deployment for c in a.capacity} == {"baseline", "eagle3-domain-g3", "eagle3-domain-auto"}
    assert a.cost_model.fitted and len(a.adaptive) == 4 and len(a.quality_tests) == 4


def test_an_old_results_file_loads_into_the_new_names():
    """The fixture's lines carry the names written before the refactor: ``spec`` with vLLM's counter names on
    a point, ``spec`` for vLLM's per-request metrics on a record."""
    from cartspec.results import AcceptanceStats, load_results

    raw = [json.loads(line) for line in (DATA / "results.jsonl").read_text().splitlines()]
    old = next(r for r in raw if r["config"]["method"] == "eagle3" and r["status"] == "ok")
    assert set(old["spec"]) == {"drafts", "draft_tokens", "accepted", "accepted_per_pos", "source"}
    assert "spec" in old["records"][0] and "acceptance" not in old
    point = next(r for r in load_results(DATA) if r.key == old["key"])
    acc = point.acceptance
    assert (acc.steps, acc.drafted, acc.accepted) == (old["spec"]["drafts"], old["spec"]["draft_tokens"],
                                                      old["spec"]["accepted"])
    assert acc.per_position == old["spec"]["accepted_per_pos"]
    assert point.tau == pytest.approx(1 + old["spec"]["accepted"] / old["spec"]["drafts"])
    assert point.records[0].request_spec_metrics == old["records"][0]["spec"]
    assert point.deployment.deployment_spec == old["deployment"]["spec"]
    # and what the new version writes loads back the same
    assert type(point).model_validate_json(point.model_dump_json()) == point
    assert AcceptanceStats.model_validate(acc.model_dump()) == acc


def test_a_point_gives_the_deployment_spec_it_was_measured_with_typed():
    """``measured_spec``: the stored runs' specs (kept as the JSON they were written with, so their keys hold)
    read as serving's ``DeploymentSpec``; no spec (an external endpoint): None; one this version cannot
    read: an error naming the point."""
    from cartspec.analysis.specs import measured_spec
    from cartspec.results import PointConfig, load_results
    from cartspec.serving.spec import DeploymentSpec

    for p in load_results(DATA):
        spec = measured_spec(p.config)
        assert isinstance(spec, DeploymentSpec) and spec.dtype == p.config.spec["dtype"] == "float32"
        assert spec.speculative.method == p.config.method
        assert spec.speculative.adaptive == p.config.deployment.endswith("-auto")
        assert not spec.speculative.adaptive or spec.speculative.schedule
    assert measured_spec(PointConfig(deployment="endpoint", method="none", n_requests=1)) is None
    odd = PointConfig(deployment="odd", method="eagle3", concurrency=2, n_requests=1,
                      spec={"speculative": {"method": "eagle3", "num_speculative_tokens": 3}})  # no head
    with pytest.raises(ValueError, match="odd at c=2"):
        measured_spec(odd)


def test_acceptance_is_undefined_without_drafts_and_pools_by_counts():
    from cartspec.results import AcceptanceStats

    empty = AcceptanceStats()
    assert empty.rate is None and empty.tau is None and empty.per_position_rate == []
    a = AcceptanceStats(drafted=30, accepted=12, steps=10, per_position=[6, 4, 2])
    b = AcceptanceStats(drafted=30, accepted=3, steps=10, per_position=[3])
    both = AcceptanceStats.pooled([a, b])
    assert (both.drafted, both.accepted, both.steps, both.per_position) == (60, 15, 20, [9, 4, 2])
    assert both.rate == pytest.approx(15 / 60) and both.tau == pytest.approx(1 + 15 / 20)
    assert (a + b).rate == both.rate and both.per_position_rate == pytest.approx([0.45, 0.2, 0.1])


def test_run_manifest_reads_an_old_run_json_and_writes_it_back(tmp_path):
    from cartspec.results import RunManifest

    m = RunManifest.load(DATA)
    assert m.preset == "paper" and m.invocations and m.seconds == m.invocations[0].seconds
    m.save(tmp_path)
    old = json.loads((DATA / "run.json").read_text())
    new = json.loads((tmp_path / "run.json").read_text())
    assert _missing_or_changed(old, new) == []
    assert RunManifest.load(tmp_path / "nowhere") == RunManifest()


def test_the_report_renders_from_the_loaded_summary(run_dir, tmp_path):
    """report.html is a function of the analysis alone: rendering the loaded summary gives the same page."""
    from cartspec.analysis.models import StudyAnalysis
    from cartspec.report.build import render_report

    rep = render_report(StudyAnalysis.load(run_dir), tmp_path)
    assert rep.html.read_text() == (run_dir / "report.html").read_text()


def _sliced(deployment: str, method: str, gamma: int | None, throughputs: list[float], schedule=None,
            beside=("baseline", "eagle3-domain-g3", "eagle3-domain-g5", "eagle3-domain-auto",
                    "eagle3-domain-stop0.9-g5"), draft_stop: float | None = None):
    """A point at 4 streams, T=0, measured in slices of 100 tokens at the given throughputs, in turn
    with ``beside``."""
    from cartspec.results import PointConfig, PointResult, PointSlice, RequestRecord

    gammas = [gamma or 0] + [k for *_, k in schedule or []]
    spec = {"speculative": {"method": method, "adaptive": schedule is not None, "schedule": schedule}
            if method == "none" else {"method": method, "num_speculative_tokens": max(max(gammas), 1),
                                      "model": "domain", "adaptive": schedule is not None, "schedule": schedule,
                                      "draft_stop": draft_stop}}
    cfg = PointConfig(deployment=deployment, method=method, gamma=gamma, spec=spec, concurrency=4,
                      n_requests=8 * len(throughputs), rounds=len(throughputs))
    slices = [PointSlice(wall_s=100 / t, n_requests=8, output_tokens=100) for t in throughputs]
    records = [RequestRecord(id=f"r{i}", e2el=1.0, output_tokens=100 // 8, text="{}")
               for i in range(8 * len(throughputs))]
    res = PointResult.measured(cfg, records, sum(s.wall_s for s in slices), slices=slices,
                               beside=[d for d in beside if d != deployment])
    return res.model_copy(update={"output_tokens": 100 * len(throughputs),
                                  "output_throughput": 100 * len(throughputs) / res.wall_s})


def test_a_ratio_of_points_in_rounds_gets_a_paired_interval_from_their_slices():
    from cartspec.analysis.rows import slice_ratio_ci

    # the host drifts by ±20% from slice to slice, but each pair runs at 1.10 : 1 within ±1%
    drift = [1.0, 0.8, 1.2, 0.9]
    a = _sliced("eagle3-domain-g3", "eagle3", 3, [110 * d * e for d, e in zip(drift, [1.01, 0.99, 1.0, 1.0])])
    b = _sliced("baseline", "none", None, [100 * d for d in drift])
    lo, hi = slice_ratio_ci(a, b)
    assert 1.07 < lo < 1.10 < hi < 1.13
    # pairs that disagree widely give a wide interval; a point not in rounds gives none
    c = _sliced("eagle3-domain-g5", "eagle3", 5, [110 * d * e for d, e in zip(drift, [1.3, 0.8, 1.2, 0.8])])
    lo2, hi2 = slice_ratio_ci(c, b)
    assert lo2 < 0.95 and hi2 > 1.3
    assert slice_ratio_ci(_sliced("x", "none", None, [100.0]), _sliced("y", "none", None, [90.0])) is None
    assert slice_ratio_ci(a, _sliced("y", "none", None, [100.0, 90.0])) is None  # slices must pair
    # slices of a deployment measured in another group (or run) pair with nothing
    apart = _sliced("eagle3-domain-g3", "eagle3", 3, [110 * d for d in drift], beside=("eagle3-domain-g5",))
    assert slice_ratio_ci(apart, b) is None


def test_the_adaptive_goal_is_met_missed_or_within_the_noise_of_its_slices():
    from cartspec.analysis.adaptive import adaptive_table
    from cartspec.analysis.rows import study_rows

    sched = [[1, 64, 0]]  # decodes plainly: the adaptive server is a baseline
    drift = [1.0, 0.85, 1.1, 0.95]
    base = _sliced("baseline", "none", None, [100 * d for d in drift])
    same = _sliced("eagle3-domain-auto", "eagle3", None, [100 * d * e for d, e in zip(drift, [0.97, 1.02, 0.99, 1.0])],
                   schedule=sched)
    results = [base, same]
    row, = adaptive_table(study_rows(results), results)
    assert row.vs_baseline < 1.0 and not row.meets  # a point estimate alone: missed
    assert row.within_noise and row.vs_baseline_ci95[0] < 1.0 < row.vs_baseline_ci95[1]
    # a consistent 10% loss is a miss whatever the noise
    slow = _sliced("eagle3-domain-auto", "eagle3", None, [90 * d * e for d, e in zip(drift, [0.99, 1.01, 1.0, 1.0])],
                   schedule=sched)
    row, = adaptive_table(study_rows([base, slow]), [base, slow])
    assert not row.meets and row.within_noise is False and row.vs_baseline_ci95[1] < 1.0
    # the speedup column carries the interval too
    spec_row = next(r for r in study_rows([base, slow]) if r.speculative)
    assert spec_row.speedup_ci95 is not None and spec_row.speedup_ci95[1] < 1.0


def test_the_adaptive_point_is_set_beside_the_fixed_row_that_runs_its_gamma():
    """Where the schedule runs γ=5 at the load, the yardstick is the γ=5 row even when γ=3 measured faster;
    where it runs γ=0, the baseline."""
    from cartspec.analysis.adaptive import adaptive_table
    from cartspec.analysis.rows import study_rows

    base = _sliced("baseline", "none", None, [100.0, 100.0, 100.0, 100.0])
    g3 = _sliced("eagle3-domain-g3", "eagle3", 3, [160.0, 150.0, 155.0, 165.0])
    g5 = _sliced("eagle3-domain-g5", "eagle3", 5, [150.0, 140.0, 145.0, 150.0])
    auto = _sliced("eagle3-domain-auto", "eagle3", None, [147.0, 140.0, 144.0, 150.0], schedule=[[1, 2, 3], [3, 64, 5]])
    results = [base, g3, g5, auto]
    row, = adaptive_table(study_rows(results), results)
    assert row.gamma_at_load == 5 and row.best_fixed == "eagle3-domain-g3" and not row.meets
    assert row.same_gamma == "eagle3-domain-g5" and row.vs_same_gamma == pytest.approx(auto.output_throughput / g5.output_throughput)
    lo, hi = row.vs_same_gamma_ci95
    assert lo < 0.995 < hi
    plain = _sliced("eagle3-domain-auto", "eagle3", None, [101.0, 99.0, 100.0, 100.0], schedule=[[1, 64, 0]])
    row, = adaptive_table(study_rows([base, g3, plain]), [base, g3, plain])
    assert row.same_gamma == "baseline" and row.vs_same_gamma == pytest.approx(1.0, abs=1e-3)
    # no fixed row at the schedule's γ: no yardstick
    odd = _sliced("eagle3-domain-auto", "eagle3", None, [150.0] * 4, schedule=[[1, 64, 4]])
    row, = adaptive_table(study_rows([base, g3, odd]), [base, g3, odd])
    assert row.same_gamma is None and row.vs_same_gamma is None


def test_a_draft_cut_per_request_is_held_to_the_adaptive_goal_beside_the_fixed_rows():
    """The per-request cut needs no schedule; its rows sit in the adaptive table beside the best fixed γ
    and the baseline (never beside another adaptive row)."""
    from cartspec.analysis.adaptive import adaptive_table
    from cartspec.analysis.rows import study_rows

    base = _sliced("baseline", "none", None, [100.0, 100.0, 100.0, 100.0])
    g3 = _sliced("eagle3-domain-g3", "eagle3", 3, [150.0, 140.0, 145.0, 150.0])
    g5 = _sliced("eagle3-domain-g5", "eagle3", 5, [160.0, 150.0, 155.0, 165.0])
    auto = _sliced("eagle3-domain-auto", "eagle3", None, [170.0] * 4, schedule=[[1, 64, 5]])
    cut = _sliced("eagle3-domain-stop0.9-g5", "eagle3", 5, [158.0, 149.0, 150.0, 160.0], draft_stop=0.9)
    results = [base, g3, g5, auto, cut]
    rows = {r.deployment: r for r in adaptive_table(study_rows(results), results)}
    assert set(rows) == {"eagle3-domain-auto", "eagle3-domain-stop0.9-g5"}
    row = rows["eagle3-domain-stop0.9-g5"]
    assert row.draft_stop == 0.9 and row.gamma_at_load is None and row.schedule == []
    # the best fixed deployment is γ=5, not the faster schedule
    assert row.best_fixed == "eagle3-domain-g5" and row.meets
    assert row.vs_best_fixed == pytest.approx(cut.output_throughput / g5.output_throughput)
    assert row.vs_baseline_ci95[0] > 1.0 and row.same_gamma is None
    # the schedule is not set beside the cut either
    assert rows["eagle3-domain-auto"].best_fixed == "eagle3-domain-g5" and rows["eagle3-domain-auto"].draft_stop is None
    slow = _sliced("eagle3-domain-stop0.9-g5", "eagle3", 5, [90.0, 91.0, 89.0, 90.0], draft_stop=0.9)
    row, = adaptive_table(study_rows([base, g5, slow]), [base, g5, slow])
    assert not row.meets and row.within_noise is False


def test_the_cost_model_leaves_out_a_draft_cut_per_request():
    """A cut verifies fewer than b·(γ+1) tokens a step, which the step-cost model does not describe."""
    from cartspec.analysis.cost_model import exclusion

    cut = _sliced("eagle3-domain-stop0.9-g5", "eagle3", 5, [150.0, 150.0], draft_stop=0.9)
    assert "per request" in exclusion(cut)
    g5 = _sliced("eagle3-domain-g5", "eagle3", 5, [150.0, 150.0])
    assert "per request" not in (exclusion(g5) or "")


def test_the_report_header_says_what_cartspecs_vllm_plugin_did_in_the_deployments():
    from cartspec.analysis.study import patch_summary
    from cartspec.results import DeploymentInfo, PointConfig, PointResult

    def point(label, patches):
        return PointResult(key=label, status="ok",
                           config=PointConfig(deployment=label, method="none", concurrency=1, n_requests=1),
                           deployment=DeploymentInfo(label=label, method="none", model="m",
                                                     versions={"vllm_patches": patches}))

    results = [point("baseline", "cpu_expand=applied, hybrid=skipped"),
               point("baseline", "cpu_expand=applied, hybrid=skipped"),  # the same deployment, another point
               point("hybrid-domain-g3", "cpu_expand=applied, hybrid=applied"),
               point("eagle3-domain-g3", "cpu_expand=applied, hybrid=skipped")]
    assert patch_summary(results) == {"cpu_expand": "applied",
                                      "hybrid": "skipped in 2 of 3 deployments, applied in 1 of 3 deployments"}
    assert patch_summary(results[:1]) == {"cpu_expand": "applied", "hybrid": "skipped"}
    assert patch_summary([]) == {}


def test_the_verdict_states_greedy_parity_per_dtype_and_load_beside_the_paired_test():
    from cartspec.analysis.models import StudyRow
    from cartspec.report.prose import parity_line, quality_line

    def row(dep, c, dtype, agree):
        return StudyRow(deployment=dep, method="eagle3", concurrency=c, dtype=dtype, status="ok",
                        agreement_vs_baseline=agree, json_valid=1.0, exact_match=0.9)

    rows = [row("eagle3-domain-g3", 1, "bfloat16", 1.0), row("hybrid-domain-g3", 1, "bfloat16", 0.95),
            row("eagle3-domain-g3", 8, "bfloat16", 0.9), row("eagle3-domain-g3", 1, "float32", 1.0)]
    line = parity_line(rows)
    assert "bfloat16: 95% at 1 stream, 90% at 8 streams" in line and "float32: 100% at 1 stream" in line
    assert line in quality_line(rows)
    assert parity_line([row("x", 1, "bfloat16", None)]) == ""
    from cartspec.report.prose import verdict

    base = [StudyRow(deployment="baseline", method="none", concurrency=c, dtype="bfloat16", status="ok",
                     output_throughput=10.0) for c in (1, 8)]
    fast = [r.model_copy(update={"speedup_vs_baseline": 2.0, "output_throughput": 20.0}) for r in rows]
    assert line + "." in verdict(base + fast, [], 2.0)


def test_a_tagged_deployment_is_compared_with_the_baseline_of_its_own_tag():
    """A study holding two baselines that differ off their speculation (``baseline`` and ``baseline@iomp``)
    pairs each speculative deployment with the baseline of its tag, not with whichever was measured last."""
    from cartspec.analysis.rows import study_rows

    both = ("baseline", "baseline@iomp", "eagle3-domain-g3", "eagle3-domain-g3@iomp")
    pts = [_sliced("baseline", "none", None, [100.0, 100.0], beside=both),
           _sliced("eagle3-domain-g3", "eagle3", 3, [200.0, 200.0], beside=both),
           _sliced("eagle3-domain-g3@iomp", "eagle3", 3, [250.0, 250.0], beside=both),
           _sliced("baseline@iomp", "none", None, [125.0, 125.0], beside=both)]
    speedup = {r.deployment: r.speedup_vs_baseline for r in study_rows(pts)}
    assert speedup["eagle3-domain-g3"] == pytest.approx(2.0)
    assert speedup["eagle3-domain-g3@iomp"] == pytest.approx(2.0)
    # a tag with no baseline of its own is compared with the untagged one
    lone = _sliced("eagle3-domain-g3@other", "eagle3", 3, [300.0, 300.0], beside=both)
    assert {r.deployment: r.speedup_vs_baseline for r in study_rows([*pts, lone])}[
        "eagle3-domain-g3@other"] == pytest.approx(3.0)


def test_the_report_shows_where_a_steps_time_goes_and_the_prompts_share():
    """A point's engine steps (``engine_steps``, the plugin's counters) give its row drafting and verifying ms
    a step, the prompts' share of the target's tokens and the share of its time no τ shortens; the report's step
    table and the verdict show them.
    Points without counters (older runs) leave all three out of the summary."""
    from cartspec.analysis.rows import study_rows
    from cartspec.report.prose import verdict
    from cartspec.results import AcceptanceStats

    base = _sliced("baseline", "none", None, [100.0, 100.0])
    head = _sliced("eagle3-domain-g3", "eagle3", 3, [150.0, 150.0])
    head = head.model_copy(update={"engine_steps": {
        "3-4": {"steps": 10, "draft_s": 0.1, "verify_s": 0.5, "gc_s": 0.0, "requests": 40, "tokens": 200,
                "prompt_tokens": 50, "drafted": 0, "kept": 0, "decode_steps": 8, "decode_s": 0.4}},
        "acceptance": AcceptanceStats(drafted=30, accepted=20, steps=10)})  # τ 3 at γ=3
    rows = study_rows([base, head])
    b, h = sorted(rows, key=lambda r: r.speculative)
    assert (h.draft_ms, h.verify_ms, h.prefill_share) == (10.0, 50.0, 0.25)
    assert (h.decode_ms, h.prefill_time_share) == (50.0, pytest.approx(1 / 3, abs=1e-4))
    assert b.verify_ms is None and "prefill_share" not in b.model_dump() and "prefill_share" in h.model_dump()
    assert "decode_ms" not in b.model_dump()
    # two prefilling steps of 0.1 s (their time, 0.2 s, less two decoding steps of 0.05 s), and the two
    # requests' first steps at 0.05 s shared by four: 0.125 s of the 0.6 s no τ shortens
    assert h.fixed_time_share == pytest.approx(0.125 / 0.6, abs=1e-4)
    assert "work no draft can shorten (what the prompts add to their steps, and each request's first step) took " \
           "21% of its engine's time at c4" in verdict(rows, [], 2.0)
    # a draft accepted in full (τ = γ + 1 = 4) with the same step costs: the decoding share divided by 4 / τ
    full = 1 / ((1 - 0.125 / 0.6) / (4 / 3) + 0.125 / 0.6)
    assert h.tau == 3.0
    assert h.draft_headroom == pytest.approx(full, abs=1e-4) and full > 1.0 and b.draft_headroom is None
    assert f"so a draft accepted in full would add at most {full - 1:.0%} with the same step costs" \
        in verdict(rows, [], 2.0)
    # drafters that draft less than γ where they find nothing (the schema drafter, n-gram), or a draft cut per
    # request: their τ does not say what a full draft would cost, so no headroom
    for dep, spec in (("schema-g3", {"method": "schema", "num_speculative_tokens": 3}),
                      ("ngram-g3", {"method": "ngram", "num_speculative_tokens": 3}),
                      ("eagle3-domain-stop0.9-g3", {**head.config.spec["speculative"], "draft_stop": 0.9})):
        cfg = head.config.model_copy(update={"deployment": dep, "method": spec["method"],
                                             "spec": {"speculative": spec}})
        row = next(r for r in study_rows([base, head.model_copy(update={"config": cfg})]) if r.deployment == dep)
        assert row.fixed_time_share is not None and row.draft_headroom is None, dep
    # step files without decoding steps' time (older runs): the prompts' share of the tokens
    older = head.model_copy(update={"engine_steps": {"3-4": {
        k: v for k, v in head.engine_steps["3-4"].items() if k not in ("decode_steps", "decode_s")}}})
    old_rows = study_rows([base, older])
    assert all(r.fixed_time_share is None for r in old_rows)
    assert "the prompts' prefill, which speculation does not shorten, was 25% of the tokens its target ran at c4" \
        in verdict(old_rows, [], 2.0)


def test_a_runs_report_gains_the_step_table_where_its_points_have_step_counts(tmp_path):
    from cartspec.report.build import build_report

    lines = (DATA / "results.jsonl").read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if '"method": "eagle3"' in line or '"method":"eagle3"' in line)
    point = json.loads(lines[i])
    point["engine_steps"] = {"1": {"steps": 4, "draft_s": 0.02, "verify_s": 0.1, "gc_s": 0.0, "requests": 4,
                                   "tokens": 16, "prompt_tokens": 4, "drafted": 0, "kept": 0}}
    lines[i] = json.dumps(point)
    (tmp_path / "results.jsonl").write_text("\n".join(lines) + "\n")
    for name in ("run.json", "quality.json"):
        shutil.copy(DATA / name, tmp_path / name)
    rep = build_report(tmp_path)
    page = rep.html.read_text()
    assert "Where an engine step's time goes" in page and "<td>25.0%</td>" in page
    row = next(r for r in json.loads(rep.summary.read_text())["points"] if r.get("verify_ms") is not None)
    assert (row["draft_ms"], row["verify_ms"], row["prefill_share"]) == (5.0, 25.0, 0.25)


def test_the_hybrid_is_set_beside_its_head_with_the_gain_its_tau_can_buy(tmp_path):
    """A hybrid point pairs with the head alone at the same γ and load; its ratio is read against the ratio its
    τ gain allows where a share of the time is fixed (prompts' prefill, a request's first step), and the goal
    1 + 0.8 (τ ratio − 1) is marked out of reach where it is above that; the report shows the table, and a run
    without a hybrid has none."""
    from cartspec.analysis.pairs import attainable, pair_table
    from cartspec.analysis.rows import study_rows

    assert attainable(1.1, 0.0) == pytest.approx(1.1) and attainable(1.1, 1.0) == pytest.approx(1.0)
    assert attainable(1.1, 0.5) == pytest.approx(1 / (0.5 / 1.1 + 0.5))

    def steps(prefill_s, decode_s):  # 10 steps of 6 requests, 2 of which prefilled a prompt each
        return {"5-8": {"steps": 10, "draft_s": 0.1, "verify_s": prefill_s + decode_s - 0.1, "gc_s": 0.0,
                        "requests": 60, "tokens": 300, "prompt_tokens": 100, "drafted": 0, "kept": 0,
                        "decode_steps": 8, "decode_s": decode_s, "prompts": 2}}

    def tau(r, value):
        from cartspec.results import AcceptanceStats

        return r.model_copy(update={"acceptance": AcceptanceStats(steps=100, drafted=300,
                                                                  accepted=round(100 * (value - 1)))})

    head = tau(_sliced("eagle3-domain-g3", "eagle3", 3, [100.0, 110.0, 90.0, 100.0]), 3.3)
    # 40% of the time in prefilling steps: 2 × 0.125 s above a decoding step's 0.075 s, and a request's first
    # step, 0.075 s shared by 6, are 27.5% that τ does not shorten
    head = head.model_copy(update={"engine_steps": steps(0.4, 0.6)})
    hyb = tau(_sliced("hybrid-domain-g3", "hybrid", 3, [105.0, 114.0, 95.0, 104.0],
                      beside=("eagle3-domain-g3",)), 3.63)
    other_gamma = tau(_sliced("eagle3-domain-g5", "eagle3", 5, [120.0] * 4), 4.0)
    results = [head, hyb, other_gamma]
    row, = pair_table(study_rows(results), results)
    assert (row.deployment, row.head_deployment, row.gamma) == ("hybrid-domain-g3", "eagle3-domain-g3", 3)
    assert row.tau_ratio == pytest.approx(1.1) and row.goal == pytest.approx(1.08)
    assert row.fixed_time_share == pytest.approx(0.275)
    assert row.attainable == pytest.approx(1 / (0.725 / 1.1 + 0.275)) and row.attainable < row.goal
    assert row.goal_attainable is False and not row.meets_goal
    assert row.ratio == pytest.approx(hyb.output_throughput / head.output_throughput)
    assert row.kept == pytest.approx((row.ratio - 1) / (row.attainable - 1))
    lo, hi = row.ratio_ci95
    assert lo < row.ratio < hi
    # with no prefill in the time the goal is within reach, and a ratio above it meets it
    fast = tau(_sliced("hybrid-domain-g3", "hybrid", 3, [112.0, 121.0, 99.0, 110.0], beside=("eagle3-domain-g3",)),
               3.63)
    plain_head = head.model_copy(update={"engine_steps": steps(0.0, 1.0)})
    row, = pair_table(study_rows([plain_head, fast]), [plain_head, fast])
    assert row.attainable == pytest.approx(1.1) and row.goal_attainable and row.meets_goal
    # the report of such a run shows the table; the golden run (no hybrid) keeps its summary without one
    from cartspec.report.build import build_report

    (tmp_path / "results.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in results))
    rep = build_report(tmp_path)
    assert "The hybrid beside its head" in rep.html.read_text() and "out of reach" in rep.html.read_text()
    assert json.loads(rep.summary.read_text())["hybrid_pairs"][0]["head_deployment"] == "eagle3-domain-g3"
    assert pair_table(study_rows([head, other_gamma]), [head, other_gamma]) == []
