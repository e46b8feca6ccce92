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
