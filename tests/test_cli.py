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


def test_draft_acceptance_names_the_servers_error_when_its_requests_fail(tmp_path):
    """A server that answers every request with a 500 (vLLM's engine core died): ``draft acceptance`` exits
    with a one-line error that counts the failures and says where the cause is, not a traceback; where this
    process started the server, the first error of its log is in the message (``requests_failed``)."""
    import http.server
    import json
    import threading
    from types import SimpleNamespace

    from cartspec.draft.acceptance import requests_failed
    from cartspec.serving.endpoint import EndpointError
    from cartspec.serving.server import DeploymentError

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"data": [{"id": "m"}]} if self.path == "/v1/models" else {})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(500, {"error": {"message": "EngineCore encountered an issue. See stack trace (above)"}})

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    out = tmp_path / "acc.json"
    try:
        r = runner.invoke(app, ["draft", "acceptance", "--method", "ngram", "--server",
                                f"http://127.0.0.1:{srv.server_address[1]}", "--served-name", "m", "--limit", "3",
                                "--out", str(out)])
    finally:
        srv.shutdown()
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "3 of 3 requests failed" in text and "own log" in text and "Traceback" not in r.output
    assert not out.exists()

    log = tmp_path / "vllm.log"
    log.write_text("(Worker pid=1) ERROR [multiproc_executor.py:1063] ImportError: cannot import name 'x' from 'y'\n"
                   "(APIServer pid=2) ERROR vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue\n")
    from cartspec.serving.endpoint import VllmEndpoint

    ep = VllmEndpoint.__new__(VllmEndpoint)
    ep.server, ep.url = SimpleNamespace(log_path=log), "http://127.0.0.1:1"
    err = requests_failed(ep, 2, 5, RuntimeError("model server answered 500"))
    assert isinstance(err, DeploymentError)
    assert "2 of 5 requests failed" in str(err) and "ImportError: cannot import name 'x'" in str(err)
    assert str(log) in str(err)
    log.write_text("INFO all fine\n")
    assert "records no error" in str(requests_failed(ep, 1, 1, RuntimeError("500")))
    plain = SimpleNamespace(url="http://h", server=None, log_cause=lambda: None)
    assert isinstance(requests_failed(plain, 1, 1, RuntimeError("500")), EndpointError)
