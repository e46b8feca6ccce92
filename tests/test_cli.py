"""Bad input to the CLI: a clear error that says what to do, exit code 2, nothing started."""

from typer.testing import CliRunner

from cartspec.cli import app

runner = CliRunner()


def test_missing_model_directory(tmp_path):
    r = runner.invoke(app, ["eval-model", "--model", str(tmp_path / "nope"), "--data", "dev",
                            "--out", str(tmp_path / "o.json")])
    assert r.exit_code == 2
    assert "model directory not found" in r.output
    assert not (tmp_path / "o.json").exists()


def test_malformed_request_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "fine"}\n{"qurey": "typo"}\n')
    r = runner.invoke(app, ["eval-model", "--data", str(bad), "--out", str(tmp_path / "o.json")])
    assert r.exit_code == 2
    assert "bad.jsonl:2" in r.output


def test_data_command_writes_splits(tmp_path):
    r = runner.invoke(app, ["data", "--out", str(tmp_path), "--train", "30", "--dev", "5", "--test", "5"])
    assert r.exit_code == 0, r.output
    from cartspec.task.data import read_requests

    assert len(read_requests(tmp_path / "train.jsonl")) == 30
    assert len(read_requests(tmp_path / "test.jsonl")) == 5


def test_draft_acceptance_server_options_reach_the_measurement(tmp_path, monkeypatch):
    """``draft acceptance --server``: its settings without --server and a key variable that holds nothing are
    refused before anything runs; given, the URL, served name and key reach ``measure_vllm`` and the JSON
    records the variable's name, never the key."""
    import json

    import cartspec.draft.acceptance as acceptance

    out = tmp_path / "acc.json"
    r = runner.invoke(app, ["draft", "acceptance", "--method", "ngram", "--served-name", "m", "--out", str(out)])
    assert r.exit_code == 2 and "settings of --server" in r.output
    monkeypatch.delenv("CARTSPEC_TEST_KEY", raising=False)
    r = runner.invoke(app, ["draft", "acceptance", "--method", "ngram", "--server", "http://127.0.0.1:9",
                            "--server-api-key-env", "CARTSPEC_TEST_KEY", "--out", str(out)])
    assert r.exit_code == 2 and "CARTSPEC_TEST_KEY" in r.output and not out.exists()

    seen: dict = {}

    def fake_measure(target, method, gamma, reqs, **kw):
        seen.update(kw, n=len(reqs))
        return {"mode": "vllm", "n": len(reqs), "tau": None, "acceptance_rate": None, "per_position": [],
                "by_class": {}, "server": kw["server"]}

    monkeypatch.setattr(acceptance, "measure_vllm", fake_measure)
    monkeypatch.setenv("CARTSPEC_TEST_KEY", "sekret")
    r = runner.invoke(app, ["draft", "acceptance", "--method", "ngram", "--server", "http://127.0.0.1:9",
                            "--served-name", "m", "--server-api-key-env", "CARTSPEC_TEST_KEY", "--limit", "2",
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert (seen["server"], seen["served_name"], seen["api_key"], seen["n"]) == ("http://127.0.0.1:9", "m", "sekret", 2)
    written = out.read_text()
    assert json.loads(written)["server_api_key_env"] == "CARTSPEC_TEST_KEY" and "sekret" not in written


def test_study_builds_the_report_once_and_ends_with_its_path(tmp_path, monkeypatch):
    """``cartspec study`` after its sweep: the quality step writes quality.json only, the command builds the
    report, once, and its last lines name the report and the summary (the sweep itself stubbed: the stored
    run is already measured)."""
    import shutil
    from pathlib import Path

    import cartspec.bench.sweep as sweep
    import cartspec.report.build as build

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "data" / "study_v1", run)
    monkeypatch.setattr(sweep, "run_sweep", lambda plan, out, **kw: [])
    built = []
    real = build.build_report
    monkeypatch.setattr(build, "build_report", lambda *a, **kw: built.append(a) or real(*a, **kw))
    r = runner.invoke(app, ["study", "--out", str(run), "--deployments", "baseline"])
    assert r.exit_code == 0, r.output
    assert len(built) == 1
    tail = r.output.strip().splitlines()[-2:]
    assert tail == [f"report: {run / 'report.html'}", f"summary: {run / 'summary.json'}"]
