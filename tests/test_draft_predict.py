"""``cartspec draft predict``: a candidate drafter's τ read against a study's measured points (the τ ratio
divides the share of the engine's time that τ shortens; the fixed share stays)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cartspec.analysis.models import StudyRow
from cartspec.analysis.predict import PredictError, Prediction, pick_deployment, predict
from cartspec.draft.acceptance import AcceptanceReport

DATA = Path(__file__).parent / "data" / "study_v1"


def _row(dep: str, method: str = "eagle3", c: int = 1, tok_s: float = 50.0, tau: float = 3.0,
         fixed: float | None = 0.2, gamma: int = 3, head: str = "domain", temperature: float = 0.0) -> StudyRow:
    return StudyRow(deployment=dep, method=method, gamma=gamma, head=head, concurrency=c, temperature=temperature,
                    status="ok", output_throughput=tok_s, tau=tau, fixed_time_share=fixed, speedup_vs_baseline=2.0)


def _report(tau: float, gamma: int = 3, method: str = "eagle3", data: str = "test", n: int = 100,
            head: str = "domain") -> AcceptanceReport:
    return AcceptanceReport(tau=tau, gamma=gamma, method=method, data=data, n=n, head_name=head, temperature=0.0,
                            mode="vllm")


def test_the_tau_ratio_divides_only_the_time_tau_shortens():
    rows = [_row("eagle3-domain-g3", c=1, fixed=0.2), _row("eagle3-domain-g3", c=8, tok_s=120.0, fixed=0.35),
            _row("eagle3-domain-g3", c=8, temperature=0.5), _row("baseline", method="none", gamma=None, head=None)]
    res = predict(rows, _report(3.3))
    assert res.deployment == "eagle3-domain-g3" and [p.concurrency for p in res.points] == [1, 8]  # T=0 only
    one, eight = res.points
    # τ ratio 1.1: 80% of the time shrinks to 0.8 / 1.1, the fixed 20% stays
    assert one.tau_ratio == pytest.approx(1.1)
    assert one.ratio == pytest.approx(1 / (0.8 / 1.1 + 0.2))
    assert one.predicted_throughput == pytest.approx(50.0 / (0.8 / 1.1 + 0.2))
    assert one.predicted_speedup == pytest.approx(2.0 / (0.8 / 1.1 + 0.2))
    # a larger fixed share buys less of the same τ gain
    assert 1.0 < eight.ratio < one.ratio < 1.1
    # a paired reference: its τ, not the point's, is the ratio's denominator
    paired = predict(rows, _report(3.3), reference=_report(3.2))
    assert paired.points[0].tau_ratio == pytest.approx(3.3 / 3.2) and paired.reference_tau == 3.2
    # the gate's two reports (no --data name, no head name, the same held-out requests) pair as well
    gate = predict(rows, _report(3.3, data=None, head=None), reference=_report(3.2, data=None, head=None))
    assert gate.deployment == "eagle3-domain-g3" and gate.points[0].tau_ratio == pytest.approx(3.3 / 3.2)
    # the same τ as the point's predicts the point
    assert predict(rows, _report(3.0)).points[0].predicted_throughput == pytest.approx(50.0)


def test_the_prediction_round_trips_through_its_file(tmp_path):
    res = predict([_row("eagle3-domain-g3")], _report(3.3), run="runs/x", candidate_path="new.json")
    assert Prediction.load(res.save(tmp_path / "p.json")) == res


def test_the_deployment_is_the_one_at_the_candidates_gamma_and_method():
    rows = [_row("eagle3-domain-g3"), _row("hybrid-domain-g3", method="hybrid"), _row("eagle3-domain-g5", gamma=5),
            _row("eagle3-other-g3", head="other")]
    assert pick_deployment(rows, 3, "hybrid", "domain") == "hybrid-domain-g3"
    assert pick_deployment(rows, 3, "eagle3", "domain") == "eagle3-domain-g3"
    assert pick_deployment(rows, 5, "eagle3", "new-head") == "eagle3-domain-g5"  # the one EAGLE-3 at γ=5
    with pytest.raises(PredictError, match="several deployments fit"):
        pick_deployment(rows, 3, "eagle3", "new-head")
    assert pick_deployment(rows, 3, "eagle3", "new-head", "eagle3-other-g3") == "eagle3-other-g3"
    with pytest.raises(PredictError, match="no EAGLE-3 or hybrid deployment at γ=4"):
        pick_deployment(rows, 4, "eagle3", "domain")
    with pytest.raises(PredictError, match="a τ at one γ says nothing of another"):
        pick_deployment(rows, 3, "eagle3", "domain", "eagle3-domain-g5")
    with pytest.raises(PredictError, match="no deployment 'nope'"):
        pick_deployment(rows, 3, "eagle3", "domain", "nope")


def test_inputs_that_do_not_read_together_are_refused_with_what_to_do():
    rows = [_row("eagle3-domain-g3")]
    with pytest.raises(PredictError, match="measure both on the same requests"):
        predict(rows, _report(3.3), reference=_report(3.0, data="novel"))
    with pytest.raises(PredictError, match="measure both at the same γ"):
        predict(rows, _report(3.3), reference=_report(3.0, gamma=5))
    with pytest.raises(PredictError, match="no γ or no τ"):
        predict(rows, AcceptanceReport(gamma=3))
    # points counted without decoding times cannot say their fixed share: left out, with why; none left: refused
    mixed = predict([_row("eagle3-domain-g3", c=1), _row("eagle3-domain-g3", c=8, fixed=None)], _report(3.3))
    assert [p.concurrency for p in mixed.points] == [1] and "c8" in mixed.skipped[0]
    with pytest.raises(PredictError, match="run the study again"):
        predict([_row("eagle3-domain-g3", fixed=None)], _report(3.3))


def _run_with_steps(tmp_path: Path) -> Path:
    """The fixture study, its eagle3-domain-g3 points given engine step counts (a fixed share of 0.125/0.6)."""
    run = tmp_path / "run"
    shutil.copytree(DATA, run, ignore=shutil.ignore_patterns("golden"))
    lines = []
    for line in (run / "results.jsonl").read_text().splitlines():
        point = json.loads(line)
        if point["config"]["deployment"] == "eagle3-domain-g3":
            point["engine_steps"] = {"3-4": {"steps": 10, "draft_s": 0.1, "verify_s": 0.5, "gc_s": 0.0,
                                             "requests": 40, "tokens": 200, "prompt_tokens": 50, "drafted": 0,
                                             "kept": 0, "decode_steps": 8, "decode_s": 0.4}}
        lines.append(json.dumps(point))
    (run / "results.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_the_command_prints_and_writes_the_prediction(tmp_path):
    from cartspec.cli import app

    run = _run_with_steps(tmp_path)
    cand = _report(3.3).save(tmp_path / "cand.json")
    out = tmp_path / "pred.json"
    res = CliRunner().invoke(app, ["draft", "predict", "--run", str(run), "--candidate", str(cand),
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    pred = Prediction.load(out)
    assert pred.deployment == "eagle3-domain-g3" and [p.concurrency for p in pred.points] == [1, 8]
    rows = {p.concurrency: p for p in pred.points}
    s = 0.125 / 0.6
    for c, p in rows.items():
        assert p.fixed_time_share == pytest.approx(s, abs=1e-4)
        assert p.ratio == pytest.approx(1 / ((1 - s) / (3.3 / p.tau) + s), rel=1e-3)
    assert "eagle3-domain-g3" in res.output and "predicted" in res.output


def test_the_command_says_what_to_give_for_bad_input(tmp_path):
    from cartspec.cli import app

    run = _run_with_steps(tmp_path)
    cand = _report(3.3).save(tmp_path / "cand.json")
    cases = [
        (["--run", str(tmp_path / "nothing"), "--candidate", str(cand)], "holds no results.jsonl"),
        (["--run", str(run), "--candidate", str(tmp_path / "missing.json")], "does not exist"),
        (["--run", str(DATA), "--candidate", str(cand)], "run the study again"),  # no step counts
        (["--run", str(run), "--candidate", str(_report(3.3, gamma=5).save(tmp_path / "g5.json"))],
         "several deployments fit"),
    ]
    (tmp_path / "bad.json").write_text("{not json")
    cases.append((["--run", str(run), "--candidate", str(tmp_path / "bad.json")], "is not an acceptance report"))
    for args, message in cases:
        res = CliRunner().invoke(app, ["draft", "predict", *args])
        assert res.exit_code == 2, (args, res.output)
        assert message in " ".join(res.output.split()), (args, res.output)
