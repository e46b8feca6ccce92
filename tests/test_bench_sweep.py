"""The sweep: resume after a kill, failed deployments, dead servers, the summary a user reads.

Deployments here are trivial paced servers standing in for vLLM (this is a unit
test); the real-engine version is tests/test_bench_vllm.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cartspec.drafting.length import STOP_P
from cartspec.results import DeploymentInfo, load_results, results_path
from cartspec.bench.reporter import SilentReporter
from cartspec.bench.sweep import SweepPlan, parse_deployment, preset, run_sweep
from cartspec.testing.trivial_server import FakeConfig, TrivialServer
from cartspec.report.build import build_report


class FakeDeployment:
    def __init__(self, srv: TrivialServer, spec):
        self.srv, self.spec, self.dead = srv, spec, False

    @property
    def url(self) -> str:
        return self.srv.url

    def alive(self) -> bool:
        return not self.dead

    def kill(self) -> None:
        self.dead = True
        self.srv.stop()

    def describe(self) -> DeploymentInfo:
        sp = self.spec.speculative
        return DeploymentInfo(label=self.spec.label, method=sp.method, gamma=sp.num_speculative_tokens,
                              model="fake", url=self.url)

    def died_reason(self) -> str:
        return "fake server killed (simulated engine crash)"


def fake_launcher(tmp_path: Path, paces: dict[str, FakeConfig], die_after_s: dict[str, float] | None = None,
                  starts: list | None = None):
    """Starts a paced server per deployment; resolves models and heads the way vLLM's launcher does."""
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text("{}")

    @contextlib.contextmanager
    def launch(spec, log_dir):
        from cartspec.serving.server import VllmServer

        VllmServer(spec, log_dir=log_dir, model_dir=model_dir).command()  # a missing head raises here
        if starts is not None:
            starts.append(spec.label)
        with TrivialServer(paces.get(spec.label, FakeConfig())) as srv:
            dep = FakeDeployment(srv, spec)
            if die_after_s and spec.label in die_after_s:
                threading.Timer(die_after_s[spec.label], dep.kill).start()
            yield dep

    return launch


def plan(*deps: str, **kw) -> SweepPlan:
    base = dict(deployments=[parse_deployment(d, "commerce") for d in deps], concurrencies=[1, 2],
                temperatures=[0.0], n_requests=4, warmup=1, max_tokens=16)
    return SweepPlan(**{**base, **kw})


@pytest.mark.parametrize("suffix", [True, False])
def test_presets_match_the_published_grid(monkeypatch, suffix):
    from cartspec.bench import plan as plan_mod

    monkeypatch.setattr(plan_mod, "suffix_available", lambda: suffix)
    p = preset("paper")
    # the published study's deployments, the schedule tuned here, the draft cut per request, the hybrid at γ=3
    # and 5, then the drafters that need no head (n-gram, the schema drafter) and suffix decoding where it is
    # installed
    assert [d.label for d in p.deployments] == ["baseline", "eagle3-domain-g3", "eagle3-domain-g5",
                                                "eagle3-domain-auto", f"eagle3-domain-stop{STOP_P:g}-g5",
                                                "hybrid-domain-g3", "hybrid-domain-g5",
                                                "ngram-g3", "schema-g3", *(["suffix-g3"] if suffix else [])]
    assert p.interleave == 4  # the four deployments the adaptive verdict compares are measured side by side
    assert p.concurrencies == [1, 2, 4, 8, 16, 32] and p.temperatures == [0.0, 0.5]
    assert len(p.all_points()) == 12 * len(p.deployments)
    q = preset("quick")
    assert [d.label for d in q.deployments] == ["baseline", "ngram-g3", "schema-g3", "eagle3-domain-g3",
                                                 "hybrid-domain-g3"]  # its default rule, as serve deploys
    assert q.interleave == 5  # the main job's ratios are measured side by side, not minutes apart
    assert len({pt.key for pt in q.all_points()}) == len(q.all_points())


def test_suffix_without_arctic_inference_is_refused_with_what_to_do(monkeypatch):
    from cartspec.bench import plan as plan_mod

    monkeypatch.setattr(plan_mod, "suffix_available", lambda: False)
    with pytest.raises(ValueError, match="arctic-inference.*scripts/install.sh"):
        parse_deployment("suffix:3", "commerce")


def test_failed_deployment_and_dead_server_are_recorded_and_the_sweep_goes_on(tmp_path):
    paces = {"baseline": FakeConfig(tokens=6, itl_s=0.005), "ngram-g3": FakeConfig(tokens=40, itl_s=0.05),
             "ngram-g5": FakeConfig(tokens=6, itl_s=0.004)}
    starts: list[str] = []
    launcher = fake_launcher(tmp_path, paces, die_after_s={"ngram-g3": 0.4}, starts=starts)
    p = plan("baseline", "ngram:3", f"eagle3:{tmp_path / 'no-such-head'}:3", "ngram:5")
    results = run_sweep(p, tmp_path / "run", launcher=launcher)
    by = {}
    for r in results:
        by.setdefault(r.config.deployment, []).append(r)
    assert [r.status for r in by["baseline"]] == ["ok", "ok"]
    assert [r.status for r in by["ngram-g5"]] == ["ok", "ok"]  # after the failures, the sweep went on
    died = by["ngram-g3"]
    assert [r.status for r in died] == ["failed", "failed"]
    assert "simulated engine crash" in died[0].reason
    assert starts.count("ngram-g3") == 2  # restarted once, then given up
    head = [r for d, rs in by.items() if d.startswith("eagle3") for r in rs]
    assert len(head) == 2 and all(r.status == "failed" for r in head)
    assert "did not start" in head[0].reason and "no-such-head" in head[0].reason
    # the report lists the failures with their reasons
    rep = build_report(tmp_path / "run")
    html = rep.html.read_text()
    assert "no-such-head" in html and "simulated engine crash" in html
    assert "deployments measured one after another" in html
    assert "eagle3" in rep.verdict and "Failed deployments" in rep.verdict
    # a rerun retries only what failed
    starts.clear()
    run_sweep(p, tmp_path / "run", launcher=fake_launcher(tmp_path, paces, starts=starts))
    assert "baseline" not in starts and "ngram-g5" not in starts and "ngram-g3" in starts


def test_summary_json_has_one_row_per_point_with_the_study_fields(tmp_path):
    paces = {"baseline": FakeConfig(tokens=10, itl_s=0.02), "ngram-g3": FakeConfig(tokens=10, itl_s=0.01)}
    p = plan("baseline", "ngram:3", temperatures=[0.0, 0.5])
    run_sweep(p, tmp_path, launcher=fake_launcher(tmp_path, paces))
    rep = build_report(tmp_path)
    summary = json.loads(rep.summary.read_text())
    rows = summary["points"]
    assert len(rows) == 8
    need = {"method", "gamma", "concurrency", "temperature", "n_requests", "n_errors", "output_throughput",
            "ttft_p50", "tpot_p50", "e2el_p50", "e2el_p99", "acceptance_rate", "tau", "speedup_vs_baseline"}
    for row in rows:
        assert need <= row.keys()
        assert row["n_requests"] == 4 and row["n_errors"] == 0
    base = [r for r in rows if r["method"] == "none"]
    spec = [r for r in rows if r["method"] == "ngram"]
    assert all(r["speedup_vs_baseline"] == pytest.approx(1.0) for r in base)
    assert all(r["gamma"] == 3 for r in spec)
    # each speedup is the ratio to the baseline's point at the same load and temperature
    by = {(r["temperature"], r["concurrency"]): r["output_throughput"] for r in base}
    assert all(r["speedup_vs_baseline"] == pytest.approx(r["output_throughput"] / by[r["temperature"], r["concurrency"]])
               for r in spec)
    # half the time per token: about twice the throughput (the median: a point lasts under a second, and one
    # stall of this shared host can halve a single one)
    speedups = sorted(r["speedup_vs_baseline"] for r in spec)
    assert 1.4 < (speedups[1] + speedups[2]) / 2 < 2.3, speedups
    assert all(r["acceptance_rate"] == pytest.approx(1 / 3) and r["tau"] == pytest.approx(2.0) for r in spec)
    assert summary["capacity"] and summary["verdict"] == rep.verdict and "ngram-g3" in rep.verdict
    assert {c["deployment"] for c in summary["capacity"]} == {"baseline", "ngram-g3"}


def test_results_round_trip_through_the_file(tmp_path):
    run_sweep(plan("baseline", concurrencies=[2]), tmp_path,
              launcher=fake_launcher(tmp_path, {"baseline": FakeConfig(tokens=5)}))
    (res,) = load_results(tmp_path)
    line = results_path(tmp_path).read_text().splitlines()[0]
    assert json.loads(res.model_dump_json()) == json.loads(line)
    assert res.machine.cores >= 1 and res.machine.versions and len(res.records) == 4
    assert res.config.spec["model"] == "commerce" and res.deployment.method == "none"


def _study(url: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cartspec.cli", "study", "--server", url, "--out", str(out), "--concurrency", "1,2,3",
         "--temperatures", "0,0.5", "--requests", "6", "--warmup", "0", "--deployments", "ngram:3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_a_sweep_killed_mid_point_resumes_without_losing_or_redoing_points(tmp_path):
    out = tmp_path / "run"
    with TrivialServer(FakeConfig(tokens=10, itl_s=0.03)) as srv:  # ~0.3 s per request
        proc = _study(srv.url, out)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lines = results_path(out).read_text().splitlines() if results_path(out).exists() else []
            if len(lines) >= 2:
                break
            time.sleep(0.05)
        sent_before = srv.counters.requests
        while srv.counters.requests < sent_before + 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # the third point is now in flight
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        first = results_path(out).read_text().splitlines()
        assert len(first) == 2, "killed mid-point: only finished points are on disk"
        # a torn line, as if the kill had come during a write
        with results_path(out).open("a") as fh:
            fh.write(first[0][:80])
        requests_at_kill = srv.counters.requests
        proc = _study(srv.url, out)
        output, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, output
        assert "2 of 6 points already measured" in output
        resent = srv.counters.requests - requests_at_kill
    results = load_results(out)
    assert len(results) == 6 and all(r.status == "ok" for r in results)
    assert resent == 4 * 6  # four points of six requests: none of the finished ones measured again
    lines = [ln for ln in results_path(out).read_text().splitlines()]
    kept = [json.loads(ln) for ln in lines if ln.startswith("{") and ln.endswith("}")]
    assert lines[:2] == first  # finished points untouched
    keys = [k["key"] for k in kept]
    assert len(keys) == len(set(keys)) == 6
    run = json.loads((out / "run.json").read_text())
    assert len(run["invocations"]) == 2 and run["invocations"][-1]["points_skipped"] == 2
    assert (out / "report.html").exists() and (out / "summary.json").exists()


def test_open_loop_points_and_the_cli_against_an_endpoint(tmp_path):
    from typer.testing import CliRunner

    from cartspec.cli import app

    with TrivialServer(FakeConfig(tokens=6, itl_s=0.005)) as srv:
        res = CliRunner().invoke(app, ["study", "--server", srv.url, "--out", str(tmp_path), "--rates", "20,40",
                                       "--requests", "10", "--deployments", "ngram:3"])
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "summary.json").read_text())["points"]
    assert [(r["mode"], r["rate"], r["deployment"]) for r in rows] == [("open", 20.0, "ngram-g3"),
                                                                        ("open", 40.0, "ngram-g3")]
    assert all(r["n_requests"] == 10 and r["n_errors"] == 0 for r in rows)
    assert "report:" in res.output and "verdict" in res.output


def test_the_cli_sizes_points_by_requests_per_stream(tmp_path):
    from typer.testing import CliRunner

    from cartspec.cli import app

    with TrivialServer(FakeConfig(tokens=4, itl_s=0.002)) as srv:
        res = CliRunner().invoke(app, ["study", "--server", srv.url, "--out", str(tmp_path), "--concurrency", "1,4",
                                       "--requests-per-stream", "3", "--min-requests", "5", "--warmup", "0"])
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "summary.json").read_text())["points"]
    assert [(r["concurrency"], r["n_requests"]) for r in rows] == [(1, 5), (4, 12)]  # max(5, 3 x c)


def test_the_cli_measures_in_rounds_and_says_when_slices_pair_with_nothing(tmp_path):
    from typer.testing import CliRunner

    from cartspec.cli import app

    with TrivialServer(FakeConfig(tokens=4, itl_s=0.002)) as srv:
        res = CliRunner().invoke(app, ["study", "--server", srv.url, "--out", str(tmp_path), "--concurrency", "1",
                                       "--requests", "6", "--rounds", "3", "--warmup", "0"])
    assert res.exit_code == 0, res.output
    assert "--rounds without --interleave" in " ".join(res.output.split())
    point, = load_results(tmp_path)
    assert [s.n_requests for s in point.slices] == [2, 2, 2] and point.beside == []
    assert json.loads((tmp_path / "run.json").read_text())["plan"]["rounds"] == 3


def test_points_score_their_replies_and_a_deployment_that_answers_wrongly_raises_an_alarm(tmp_path):
    """Fast but wrong must show: every point records JSON validity and, at T=0, agreement with the baseline."""
    good = '{"intent": "search", "keywords": "x"}'
    paces = {"baseline": FakeConfig(tokens=10, reply=good), "ngram-g3": FakeConfig(tokens=10, reply=good),
             "ngram-g5": FakeConfig(tokens=10)}  # streams "tok tok ...": not JSON
    p = plan("baseline", "ngram:3", "ngram:5", concurrencies=[2])
    run_sweep(p, tmp_path, launcher=fake_launcher(tmp_path, paces))
    (res,) = [r for r in load_results(tmp_path) if r.config.deployment == "baseline"]
    assert all(rec.text == good for rec in res.records)  # the reply survives the results file
    rep = build_report(tmp_path)
    rows = {r["deployment"]: r for r in json.loads(rep.summary.read_text())["points"]}
    assert rows["baseline"]["json_valid"] == 1.0 and rows["baseline"]["agreement_vs_baseline"] is None
    assert rows["ngram-g3"]["json_valid"] == 1.0 and rows["ngram-g3"]["agreement_vs_baseline"] == 1.0
    assert rows["ngram-g5"]["json_valid"] == 0.0 and rows["ngram-g5"]["agreement_vs_baseline"] == 0.0
    assert rows["baseline"]["exact_match"] == 0.0  # the test split's gold is never this reply
    assert "QUALITY ALARM" in rep.verdict and "ngram-g5" in rep.verdict and "ngram-g3 at" not in rep.verdict


def test_paired_quality_test_flags_a_deployment_whose_answers_are_worse(tmp_path):
    """The report's statistics: same answers as the baseline on 16 requests -> no difference, but too few to
    show equivalence within 2 points; wrong answers -> worse, and an alarm."""
    from cartspec.task.data import Request, write_requests

    good = '{"intent": "search", "keywords": "x"}'
    reqs = [Request(id=f"q{i}", query=f"x number {i}", task="search", gold={"intent": "search", "keywords": "x"})
            for i in range(40)]
    data = write_requests(tmp_path / "reqs.jsonl", reqs)
    paces = {"baseline": FakeConfig(tokens=10, reply=good), "ngram-g3": FakeConfig(tokens=10, reply=good),
             "ngram-g5": FakeConfig(tokens=10, reply='{"intent": "search", "keywords": "y"}')}
    p = plan("baseline", "ngram:3", "ngram:5", concurrencies=[2, 4], n_requests=16, request_sets=[str(data)])
    run_sweep(p, tmp_path / "run", launcher=fake_launcher(tmp_path, paces))
    (base,) = [r for r in load_results(tmp_path / "run") if r.config.deployment == "baseline" and r.config.concurrency == 2]
    assert all(rec.exact is True and rec.task == "search" for rec in base.records)  # scored when measured
    data.unlink()  # the report needs only the results file, not the requests (or a generator that changed since)
    rep = build_report(tmp_path / "run")
    tests = {t["deployment"]: t for t in json.loads(rep.summary.read_text())["quality_tests"]}
    assert set(tests) == {"ngram-g3", "ngram-g5"}
    g3, g5 = tests["ngram-g3"], tests["ngram-g5"]
    assert g3["exact_text"] == 1.0 and g3["diff"] == 0.0 and g3["mcnemar_p"] == 1.0
    lo, hi = g3["diff_ci95"]
    assert -0.3 < lo < -0.05 and 0.05 < hi < 0.3 and g3["verdict"] == "inconclusive"  # about ±3/16
    # 16 requests answered at two loads: 32 pairs, but 16 independent requests
    assert g5["pairs"] == 32 and g5["requests"] == 16
    assert g5["accuracy_baseline"] == 1.0 and g5["accuracy_candidate"] == 0.0 and g5["verdict"] == "worse"
    assert g5["mcnemar_p"] == pytest.approx(2 / 2 ** 16)  # sign test over 16 requests, not 32 pairs
    assert "QUALITY ALARM" in rep.verdict and "exact match -100.0%" in rep.verdict
    html = rep.html.read_text()
    assert 'id="quality"' in html and "worse" in html


def test_reply_scoring_returns_scores_and_leaves_the_records_alone():
    """A point's replies are scored into a list beside the records; the records the results hold are copies
    carrying task and exact, and the records the load generator returned are unchanged."""
    from cartspec.bench.loadgen import chat_requests
    from cartspec.bench.scoring import reply_quality, score_replies, with_scores
    from cartspec.results import RequestRecord
    from cartspec.task.data import Request

    gold = {"intent": "search", "keywords": "x"}
    reqs = chat_requests([Request(id="q0", query="x", task="search", gold=gold),
                          Request(id="q1", query="y", task="search")], 16)
    records = [RequestRecord(id="q0", text='{"intent": "search", "keywords": "x"}'),
               RequestRecord(id="q1", text="not json"),
               RequestRecord(id="q0", text="late", error="HTTP 500"),
               RequestRecord(id="elsewhere", text="{}")]
    before = [r.model_dump() for r in records]
    scores = score_replies(records, reqs)
    assert [r.model_dump() for r in records] == before  # nothing written into the input
    assert [s is not None for s in scores] == [True, True, False, False]
    assert reply_quality(scores) == (0.5, 1.0)  # q1 has no gold: valid share over both, exact over q0 only
    assert reply_quality([None, None]) == (None, None)
    scored = with_scores(records, scores)
    assert [(r.task, r.exact) for r in scored] == [("search", True), ("search", None), (None, None), (None, None)]
    assert scored[2] is records[2] and scored[0] is not records[0]
    assert [r.model_dump() for r in records] == before


def _measured_order(out: Path) -> list[tuple[str, int]]:
    """(deployment, concurrency) of every point of a run, in the order it was measured."""
    rows = [json.loads(ln) for ln in results_path(out).read_text().splitlines() if ln.strip()]
    return [(r["config"]["deployment"], r["config"]["concurrency"]) for r in rows]


def test_interleaved_sweep_measures_every_point_on_all_deployments_in_rotating_order(tmp_path):
    starts: list[str] = []
    launcher = fake_launcher(tmp_path, {}, starts=starts)
    p = plan("baseline", "ngram:3", "ngram:5", concurrencies=[1, 2, 4], interleave=3)
    results = run_sweep(p, tmp_path / "run", launcher=launcher)
    assert all(r.status == "ok" for r in results) and len(results) == 9
    assert starts == ["baseline", "ngram-g3", "ngram-g5"]  # each started once, all up together
    order = _measured_order(tmp_path / "run")
    # cell by cell: every deployment at c=1, then every one at c=2, ...; who goes first rotates
    assert [c for _, c in order] == [1, 1, 1, 2, 2, 2, 4, 4, 4]
    assert [d for d, _ in order] == ["baseline", "ngram-g3", "ngram-g5", "ngram-g3", "ngram-g5", "baseline",
                                     "ngram-g5", "baseline", "ngram-g3"]
    # what the run records says so, and the servers were told to size their KV cache to share the host
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert manifest["plan"]["interleave"] == 3
    assert all(d.get("kv_cache_fit") for d in manifest["plan"]["deployments"])
    assert "up to 3 servers up at once" in build_report(tmp_path / "run").html.read_text()
    # a rerun finds everything done and starts nothing
    starts.clear()
    run_sweep(p, tmp_path / "run", launcher=launcher)
    assert starts == []


def test_interleaved_sweep_restarts_a_dead_server_once_and_the_others_go_on(tmp_path):
    starts: list[str] = []
    launcher = fake_launcher(tmp_path, {"ngram-g3": FakeConfig(tokens=40, itl_s=0.05)},
                             die_after_s={"ngram-g3": 0.4}, starts=starts)
    p = plan("baseline", "ngram:3", f"eagle3:{tmp_path / 'no-such-head'}:3", "ngram:5", interleave=4)
    by: dict[str, list] = {}
    for r in run_sweep(p, tmp_path / "run", launcher=launcher):
        by.setdefault(r.config.deployment, []).append(r)
    assert [r.status for r in by["baseline"]] == ["ok", "ok"]
    assert [r.status for r in by["ngram-g5"]] == ["ok", "ok"]
    assert [r.status for r in by["ngram-g3"]] == ["failed", "failed"]
    assert "simulated engine crash" in by["ngram-g3"][0].reason
    assert starts.count("ngram-g3") == 2  # restarted once, then given up
    head = next(rs for d, rs in by.items() if d.startswith("eagle3"))
    assert [r.status for r in head] == ["failed", "failed"] and "did not start" in head[0].reason


def test_interleaved_sweep_starts_no_server_the_memory_left_cannot_hold(tmp_path, monkeypatch):
    from cartspec.bench import grouping

    free = [10.0]  # GiB; every start takes 4, every stop gives it back

    @contextlib.contextmanager
    def launch(spec, log_dir):
        free[0] -= 4
        with fake_launcher(tmp_path, {})(spec, log_dir) as dep:
            yield dep
        free[0] += 4

    monkeypatch.setattr(grouping, "available_gib", lambda: free[0])
    p = plan("baseline", "ngram:3", "ngram:5", "ngram:7", interleave=4)
    results = run_sweep(p, tmp_path / "run", launcher=launch)
    assert all(r.status == "ok" for r in results) and len(results) == 8
    # 10 GiB: two servers (4 + 4, then 2 left < 4 + 1 margin); the other two as a second group
    assert [d for d, _ in _measured_order(tmp_path / "run")] == [
        "baseline", "ngram-g3", "ngram-g3", "baseline", "ngram-g5", "ngram-g7", "ngram-g7", "ngram-g5"]
    assert free[0] == 10.0  # every server stopped


def test_slices_split_a_point_into_runs_of_consecutive_requests_with_two_per_stream_at_least():
    from cartspec.results import PointConfig

    def bounds(n, c, rounds, samples=1):
        return PointConfig(deployment="x", method="none", concurrency=c, n_requests=n, rounds=rounds,
                           samples=samples).slice_bounds()

    assert bounds(8, 1, 1) == [(0, 8)]
    assert bounds(8, 1, 3) == [(0, 2), (2, 3), (5, 3)]
    assert bounds(20, 4, 4) == [(0, 10), (10, 10)]  # 4 slices of 5 would be bursts of 4 streams that drain
    assert bounds(4, 8, 4) == [(0, 4)]
    assert bounds(4, 2, 2, samples=2) == [(0, 4), (4, 4)]  # 8 replies: samples count


class _Order(SilentReporter):
    def __init__(self):
        self.started: list[tuple[str, int]] = []

    def point_started(self, cfg, part=0):
        self.started.append((cfg.deployment, part))


def test_points_in_rounds_take_turns_slice_by_slice_and_merge_into_the_point_a_single_run_would_give(tmp_path):
    servers: dict[str, TrivialServer] = {}
    inner = fake_launcher(tmp_path, {"ngram-g3": FakeConfig(tokens=8, itl_s=0.002)})

    @contextlib.contextmanager
    def launch(spec, log_dir):
        with inner(spec, log_dir) as dep:
            servers[spec.label] = dep.srv
            yield dep

    order = _Order()
    p = plan("baseline", "ngram:3", concurrencies=[1, 2], temperatures=[0.5], n_requests=12, warmup=0,
             interleave=2, rounds=3)
    results = run_sweep(p, tmp_path / "run", launcher=launch, reporter=order)
    assert all(r.status == "ok" for r in results) and len(results) == 4
    # c=1: 3 slices of 4 requests, the first deployment rotating at every slice; c=2: 3 slices of 4 too
    assert order.started == [("baseline", 0), ("ngram-g3", 0), ("ngram-g3", 1), ("baseline", 1),
                             ("baseline", 2), ("ngram-g3", 2),
                             ("ngram-g3", 0), ("baseline", 0), ("baseline", 1), ("ngram-g3", 1),
                             ("ngram-g3", 2), ("baseline", 2)]
    # every request of the point once, with the seed a single run gives it, on each server: paired
    for srv in servers.values():
        assert srv.counters.seeds[:12] == list(range(12))  # c=1: its slices in order, one request at a time
        assert sorted(srv.counters.seeds[12:]) == list(range(12))
    for r in results:
        assert r.n_requests == 12 and len(r.slices) == 3 and [s.n_requests for s in r.slices] == [4, 4, 4]
        assert r.wall_s == pytest.approx(sum(s.wall_s for s in r.slices))
        assert r.output_tokens == sum(s.output_tokens for s in r.slices)
        starts = [rec.start for rec in r.records]
        assert starts == sorted(starts) and starts[-1] < r.wall_s  # one clock across the slices
        assert r.beside == [d for d in ("baseline", "ngram-g3") if d != r.config.deployment]
    single = run_sweep(p.model_copy(update={"rounds": 1}), tmp_path / "single", launcher=inner)
    ids = {(r.config.deployment, r.config.concurrency): [x.id for x in sorted(r.records, key=lambda x: x.id)]
           for r in single}
    assert {(r.config.deployment, r.config.concurrency): [x.id for x in sorted(r.records, key=lambda x: x.id)]
            for r in results} == ids
    assert all(not r.slices for r in single) and all(r.key != s.key for r in results for s in single)
    # the speculative counters of the slices add up
    spec = next(r for r in results if r.config.deployment == "ngram-g3" and r.config.concurrency == 1)
    assert spec.acceptance is not None and spec.acceptance.drafted > 0


def test_restart_rounds_start_the_servers_again_in_rotated_order_and_warm_up_each_fresh_one(tmp_path):
    """An offset that follows a server process (or its start position) must land on every deployment alike:
    after each round every server is stopped and the group started again, the start order rotated by one.
    Each fresh server warms up before its first slice; the points merge as in plain rounds."""
    starts: list[str] = []
    instances: list[TrivialServer] = []
    inner = fake_launcher(tmp_path, {}, starts=starts)

    @contextlib.contextmanager
    def launch(spec, log_dir):
        with inner(spec, log_dir) as dep:
            instances.append(dep.srv)
            yield dep

    order = _Order()
    p = plan("baseline", "ngram:3", "ngram:5", concurrencies=[1, 2], temperatures=[0.5], n_requests=12, warmup=1,
             interleave=3, rounds=3, restart_rounds=True)
    results = run_sweep(p, tmp_path / "run", launcher=launch, reporter=order)
    assert all(r.status == "ok" for r in results) and len(results) == 6
    assert starts == ["baseline", "ngram-g3", "ngram-g5", "ngram-g3", "ngram-g5", "baseline",
                      "ngram-g5", "baseline", "ngram-g3"]
    assert [part for _, part in order.started] == [0] * 6 + [1] * 6 + [2] * 6  # round by round
    # warm-up seeds are drawn from 1_000_000 on: two per server in round 0 (each point's first slice), one
    # per server afterwards (its first slice after the restart), none before the round's second point
    warm = sorted(sum(1 for s in srv.counters.seeds if s >= 1_000_000) for srv in instances)
    assert warm == [1] * 6 + [2] * 3
    for label in ("baseline", "ngram-g3", "ngram-g5"):
        measured = [s for srv, who in zip(instances, starts) if who == label
                    for s in srv.counters.seeds if s < 1_000_000]
        assert sorted(measured) == sorted(list(range(12)) * 2)  # every request of both points once
    for r in results:
        assert [s.n_requests for s in r.slices] == [4, 4, 4]
        assert r.n_warmup == (3 if r.config.concurrency == 1 else 1)  # c=1 is each round's first point
        assert len(r.beside) == 2
    assert json.loads((tmp_path / "run" / "run.json").read_text())["plan"]["restart_rounds"] is True
    assert "every server started again between rounds in rotated order" in build_report(tmp_path / "run").html.read_text()


def test_the_cli_refuses_restart_rounds_without_rounds_to_restart_between(tmp_path):
    from typer.testing import CliRunner

    from cartspec.cli import app

    res = CliRunner().invoke(app, ["study", "--out", str(tmp_path), "--deployments", "baseline,ngram:3",
                                   "--interleave", "2", "--restart-rounds"])
    assert res.exit_code == 2 and "--rounds 2 or more" in " ".join(res.output.split())
    assert not (tmp_path / "results.jsonl").exists()


def test_study_plan_from_settings_refuses_and_warns_before_anything_starts():
    from cartspec.bench.study import StudySettings, StudySetupError, study_plan

    warned: list[str] = []
    settings = StudySettings(deployments=["baseline", "ngram:3"], concurrencies=[1, 2], rounds=2, interleave=1)
    plan = study_plan(settings, warn=warned.append)
    assert [d.label for d in plan.deployments] == ["baseline", "ngram-g3"] and plan.concurrencies == [1, 2]
    assert plan.rounds == 2 and any("--rounds without --interleave" in w for w in warned)
    with pytest.raises(StudySetupError, match="--restart-rounds"):
        study_plan(StudySettings(deployments=["baseline"], restart_rounds=True, rounds=1))
    with pytest.raises(StudySetupError, match="the one deployment behind it"):
        study_plan(StudySettings(server="http://127.0.0.1:9", deployments=["baseline", "ngram:3"]))
    with pytest.raises(StudySetupError, match="give --server too"):
        study_plan(StudySettings(server_api_key_env="CARTSPEC_TEST_KEY"))
    external = study_plan(StudySettings(server="http://127.0.0.1:9", served_name="m"))
    assert external.server_url == "http://127.0.0.1:9" and [d.model for d in external.deployments] == ["m"]


def test_deployments_that_differ_only_off_their_speculation_need_a_tag_to_share_a_study(tmp_path):
    """Results, slices and the report name deployments by label: two specs with the same speculation (another
    env, dtype or engine flags) would merge into one deployment's points unless told apart."""
    from cartspec.bench.study import StudySettings, StudySetupError, study_plan
    from cartspec.serving.spec import DeploymentSpec

    same = tmp_path / "same.yaml"
    same.write_text("model: commerce\nenv:\n  OMP_WAIT_POLICY: PASSIVE\n")
    with pytest.raises(StudySetupError, match=r"both labelled 'baseline'.*tag"):
        study_plan(StudySettings(deployments=["baseline"], spec_files=[str(same)]))
    tagged = tmp_path / "tagged.yaml"
    tagged.write_text("tag: passive\nmodel: commerce\nenv:\n  OMP_WAIT_POLICY: PASSIVE\n")
    plan = study_plan(StudySettings(deployments=["baseline"], spec_files=[str(tagged)]))
    assert [d.label for d in plan.deployments] == ["baseline", "baseline@passive"]
    a, b = (plan.points(d)[0] for d in plan.deployments)
    assert a.deployment != b.deployment and a.key != b.key
    # an untagged spec is written, and its points keyed, as before the field existed
    assert "tag" not in DeploymentSpec().model_dump(mode="json")
    assert DeploymentSpec.load(str(tagged)).model_dump(mode="json")["tag"] == "passive"
