"""`cartspec quality` on a constructed run: pairing by request and sample, the verdicts, summary.json,
the report, the judge (scripted), and clear errors on bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cartspec.results import PointConfig, PointResult, RequestRecord, append_result
from cartspec.task.request_sets import load_request_set
from cartspec.cli import app
from cartspec.quality.models import QualityReport
from cartspec.quality.study import QualityError, quality_for_run
from cartspec.report.build import build_report
from cartspec.task.schema import SCHEMAS, canonical_json
from cartspec.testing.trivial_server import FakeConfig, TrivialServer

runner = CliRunner()


def gold_text(req) -> str:
    return canonical_json(SCHEMAS[req.task].model_validate(req.gold))


def wrong_text(req) -> str:
    g = dict(req.gold)
    if req.task == "search":
        g["keywords"] = "garden gnome"
    else:
        g["reply"] = "Sorry, I cannot help with that."
    return canonical_json(SCHEMAS[req.task].model_validate(g))


def make_run(path, candidate, n=40, samples=10, temperature=0.5, baseline=True, label="eagle3-domain-g3"):
    """A run with a baseline answering every request right and a candidate answering ``candidate(i, j, req)``."""
    reqs = load_request_set("commerce", n)[:n]
    deps = ([("baseline", "none", lambda i, j, r: gold_text(r))] if baseline else []) + [(label, "eagle3", candidate)]
    for dep, method, reply in deps:
        cfg = PointConfig(deployment=dep, method=method, gamma=None if method == "none" else 3, concurrency=8,
                          temperature=temperature, n_requests=n, samples=samples)
        recs = [RequestRecord(id=r.id, sample=j, text=reply(i, j, r), task=r.task, e2el=0.1)
                for i, r in enumerate(reqs) for j in range(samples)]
        append_result(path, PointResult.measured(cfg, recs, wall_s=1.0))
    return reqs


def test_equal_candidate_preserved_with_samples_and_summary_has_quality(tmp_path):
    make_run(tmp_path, lambda i, j, r: gold_text(r), n=40, samples=10)
    rep = quality_for_run(tmp_path, metric="exact_match")
    assert not (tmp_path / "report.html").exists()  # the quality stage starts no report: its caller does
    build_report(tmp_path)
    (e,) = rep.entries
    assert (e.deployment, e.temperature, e.n, e.pairs, e.samples) == ("eagle3-domain-g3", 0.5, 40, 400, 10)
    assert e.verdict == "preserved" and -0.02 < e.ci_low <= e.ci_high < 0.02 and e.needed_n is None
    assert {t.metric for t in e.tests} == {"exact_match", "field_accuracy", "json_valid", "schema_valid"}
    assert e.judge is None
    summary = json.loads((tmp_path / "summary.json").read_text())
    (q,) = summary["quality"]
    for key in ("deployment", "temperature", "n", "verdict", "ci_low", "ci_high", "margin", "needed_n", "judge"):
        assert key in q
    # typed: the summary's entries and quality.json load back into the same models
    assert QualityReport.model_validate_json((tmp_path / "quality.json").read_text()) == rep
    html = (tmp_path / "report.html").read_text()
    assert 'id="quality-verdicts"' in html and "preserved" in html
    rows = {c["finding"]: c for c in summary["published_comparison"]}
    assert "quality: LLM-as-judge, pairwise" in rows and "not run" in rows["quality: LLM-as-judge, pairwise"]["ours"]
    assert "preserved" in rows["quality: paired structured tests vs gold (not in the published study)"]["ours"]


def test_degraded_candidate_is_worse_and_pairs_are_matched_by_sample(tmp_path):
    # wrong on every sample 0 and 1 of 10: 20 points worse than the baseline
    make_run(tmp_path, lambda i, j, r: wrong_text(r) if j < 2 else gold_text(r), n=30, samples=10)
    (e,) = quality_for_run(tmp_path).entries
    assert e.verdict == "worse" and e.diff == pytest.approx(-0.2) and e.ci_high < -0.02
    fields = {f.field: f for f in e.fields}
    assert any(f.diff < 0 for f in fields.values())
    build_report(tmp_path)
    verdict = json.loads((tmp_path / "summary.json").read_text())["verdict"]
    assert "QUALITY ALARM" in verdict and "eagle3-domain-g3 at T=0.5" in verdict


def test_few_requests_are_inconclusive_with_a_sample_size(tmp_path):
    make_run(tmp_path, lambda i, j, r: wrong_text(r) if i == 3 and j == 0 else gold_text(r), n=20, samples=2)
    (e,) = quality_for_run(tmp_path, metric="field_accuracy").entries
    assert e.verdict == "inconclusive" and e.needed_n > 20 and e.needed_samples > 2


def test_scripted_judge_on_the_run(tmp_path):
    from cartspec.quality.judge import JudgeSetup
    from tests.test_quality_judge import oracle

    make_run(tmp_path, lambda i, j, r: wrong_text(r) if i < 5 and j == 0 else gold_text(r), n=20, samples=2)
    with TrivialServer(FakeConfig(answer=oracle)) as srv:
        rep = quality_for_run(tmp_path, judge=JudgeSetup(url=srv.url, mode="reference", limit=10,
                                                         calibration_per_kind=2))
    (e,) = rep.entries
    j = e.judge
    assert (j.win, j.loss, j.judged, j.pairs) == (0, 5, 5, 40) and j.tie == 35
    assert sum(t["loss"] for t in j.by_task.values()) == 5 and sum(t["tie"] for t in j.by_task.values()) == 35
    assert j.calibration.reliable and j.calibration.accuracy == 1.0
    assert rep.calibrations["reference"] == j.calibration
    build_report(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    row = next(c for c in summary["published_comparison"] if c["finding"] == "quality: LLM-as-judge, pairwise")
    assert "0 wins / 35 ties / 5 losses" in row["ours"] and "accuracy 100%" in row["ours"]
    assert summary["quality"][0]["judge"]["calibration"]["position_consistency"] == 1.0


def test_errors_say_what_is_wrong(tmp_path):
    r = runner.invoke(app, ["quality", "--run", str(tmp_path / "nope")])  # before any judge starts
    assert r.exit_code == 2 and "run directory not found" in r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    r = runner.invoke(app, ["quality", "--run", str(empty)])
    assert r.exit_code == 2 and "no results.jsonl" in r.output
    nobase = tmp_path / "nobase"
    make_run(nobase, lambda i, j, r: gold_text(r), n=5, samples=1, baseline=False)
    r = runner.invoke(app, ["quality", "--run", str(nobase)])
    assert r.exit_code == 2 and "no baseline" in r.output
    r = runner.invoke(app, ["quality", "--run", str(nobase), "--no-judge"])
    assert r.exit_code == 2 and "no baseline" in r.output
    ok = tmp_path / "ok"
    make_run(ok, lambda i, j, r: gold_text(r), n=5, samples=1)
    with TrivialServer() as srv:
        dead = srv.url  # stopped: nothing listens there any more
    r = runner.invoke(app, ["quality", "--run", str(ok), "--judge", dead])
    assert r.exit_code == 2 and "unreachable" in r.output
    r = runner.invoke(app, ["quality", "--run", str(ok), "--judge", dead, "--judge-model", "x"])
    assert r.exit_code == 2 and "does not answer" in r.output
    r = runner.invoke(app, ["quality", "--run", str(ok), "--no-judge", "--judge-mode", "reference"])
    assert r.exit_code == 2 and "--no-judge turns it off" in r.output
    r = runner.invoke(app, ["quality", "--run", str(ok), "--judge-mode", "vibes"])
    assert r.exit_code == 2 and "--judge-mode must be one of" in r.output
    r = runner.invoke(app, ["quality", "--run", str(ok), "--no-judge", "--metric", "vibes"])
    assert r.exit_code == 2 and "unknown metric" in r.output
    with pytest.raises(QualityError):
        quality_for_run(ok, metric="vibes")
