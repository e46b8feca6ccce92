"""``benchmarks/agent_overhead.py``: reading GuideLLM's JSON reports, pairing the agent's runs with vLLM's, and
handing GuideLLM the server's API key without writing it anywhere.

The reports are real GuideLLM 0.8.1 output, trimmed to what the benchmark reads: ``guidellm_vllm_c8.json`` a
run of 8 streams against vLLM directly (the commerce model), ``guidellm_errored.json`` a run against GuideLLM's
mock server answering 500 after two requests.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from agent_overhead import (GUIDELLM_KEY_VAR, Run, RunMetrics, overhead_rows, parse_guidellm,  # noqa: E402
                            run_guidellm, scenario, table)

DATA = Path(__file__).parent / "data"
# what GuideLLM's console table printed for the vLLM run: TTFT and ITL medians, ms
TTFT_P50_MS, ITL_P50_MS = 6338.495, 84.528


def _report(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_a_report_gives_the_runs_throughput_ttft_and_itl():
    report = _report("guidellm_vllm_c8.json")
    m = parse_guidellm(report)
    assert (m.streams, m.requests, m.errors, m.incomplete) == (8, 8, 0, 0)
    assert m.output_tokens == 480 and m.output_tokens_p50 == 60
    assert m.ttft_p50_ms == pytest.approx(TTFT_P50_MS, abs=1e-3)
    assert m.itl_p50_ms == pytest.approx(ITL_P50_MS, abs=1e-3)
    # output tokens over the run's duration: the figure GuideLLM's own table prints as output tokens/s
    own = report["benchmarks"][0]["metrics"]["output_tokens_per_second"]["successful"]["mean"]
    assert m.output_throughput == pytest.approx(own, rel=1e-6)
    assert m.first_error is None


def test_errored_requests_are_counted_with_the_first_reason():
    m = parse_guidellm(_report("guidellm_errored.json"))
    assert (m.requests, m.errors) == (2, 2)
    assert "500 Internal Server Error" in m.first_error


@pytest.mark.parametrize("report, says", [
    ({"results": []}, "it has no benchmarks"),
    ({"benchmarks": [{"metrics": {}, "duration": 1.0}]}, "benchmarks[0].metrics.request_totals"),
    ({"benchmarks": [{}, {}]}, "one benchmark (one concurrency), found 2"),
])
def test_what_is_not_a_one_benchmark_report_is_refused_saying_what_is_missing(report, says):
    with pytest.raises(ValueError) as err:
        parse_guidellm(report)
    assert says in str(err.value)


def _m(tput: float, ttft: float, itl: float = 20.0) -> RunMetrics:
    return RunMetrics(streams=1, requests=8, errors=0, incomplete=0, duration_s=10.0, output_tokens=int(tput * 10),
                      output_throughput=tput, ttft_p50_ms=ttft, itl_p50_ms=itl, output_tokens_p50=60)


def test_rounds_are_paired_and_their_medians_judged_against_the_goals():
    runs = [
        # c=1: ratios 0.95, 0.99, 0.98 (median 0.98 >= 0.97); TTFT +5, +12, +8 ms (median +8 <= 10)
        Run("agent", 1, 0, _m(95, 105)), Run("vllm", 1, 0, _m(100, 100)),
        Run("vllm", 1, 1, _m(100, 104)), Run("agent", 1, 1, _m(99, 116)),
        Run("agent", 1, 2, _m(98, 108)), Run("vllm", 1, 2, _m(100, 100)),
        # c=8: ratios 0.96, 0.95 (median 0.955): the throughput goal is missed; TTFT +4, +6
        Run("agent", 8, 0, _m(192, 304)), Run("vllm", 8, 0, _m(200, 300)),
        Run("agent", 8, 1, _m(190, 306)), Run("vllm", 8, 1, _m(200, 300)),
        Run("agent", 8, 2, _m(100, 100)),  # a round without vLLM's run: left out
    ]
    c1, c8 = overhead_rows(runs)
    assert (c1["concurrency"], c1["rounds"], c8["rounds"]) == (1, 3, 2)
    assert c1["throughput_ratio"] == pytest.approx({"median": 0.98, "min": 0.95, "max": 0.99})
    assert c1["ttft_p50_diff_ms"] == pytest.approx({"median": 8, "min": 5, "max": 12})
    assert c1["meets_throughput_goal"] and c1["meets_ttft_goal"]
    assert c8["throughput_ratio"]["median"] == pytest.approx(0.955)
    assert not c8["meets_throughput_goal"] and c8["meets_ttft_goal"]
    assert c8["vllm_spread"] == 0 and c1["vllm_ttft_spread_ms"] == 4  # vLLM's TTFT p50: 100, 104, 100 ms
    lines = table([c1, c8]).splitlines()
    assert "throughput met, TTFT met" in lines[2] and "throughput MISSED, TTFT met" in lines[3]


FAKE_GUIDELLM = """#!{python}
import json, os, sys
settings = json.load(open(sys.argv[sys.argv.index("-c") + 1]))
report = json.load(open({fixture!r}))
if os.environ.get("LEAK"):  # a GuideLLM that wrote its key into the report
    report["config"] = {{"api_key": os.environ.get("{var}")}}
out = settings["spec"]["outputs"][0]["path"]
json.dump(report, open(out, "w"))
json.dump({{"argv": sys.argv, "key": os.environ.get("{var}")}}, open(out + ".seen", "w"))
"""


@pytest.fixture
def fake_guidellm(tmp_path):
    exe = tmp_path / "guidellm"
    exe.write_text(FAKE_GUIDELLM.format(python=sys.executable, fixture=str(DATA / "guidellm_vllm_c8.json"),
                                        var=GUIDELLM_KEY_VAR))
    exe.chmod(0o700)
    return str(exe)


def _settings(out: Path) -> dict:
    return scenario("http://127.0.0.1:1", "cartspec", "/nowhere/tokenizer", 8, 8, 100, 60, out / "run.json")


def test_the_key_reaches_guidellm_through_its_environment_only(fake_guidellm, tmp_path, monkeypatch):
    monkeypatch.delenv("LEAK", raising=False)
    m = run_guidellm(fake_guidellm, _settings(tmp_path), "run", tmp_path, "k-123-secret", None, 60)
    assert m.requests == 8
    seen = json.loads((tmp_path / "run.json.seen").read_text())
    assert seen["key"] == "k-123-secret"
    assert "k-123-secret" not in " ".join(seen["argv"])
    scenario_file = tmp_path / "run.scenario.json"
    assert "k-123-secret" not in scenario_file.read_text()
    assert stat.S_IMODE(scenario_file.stat().st_mode) == 0o600


def test_a_report_holding_the_key_is_deleted_and_the_run_fails(fake_guidellm, tmp_path, monkeypatch):
    monkeypatch.setenv("LEAK", "1")
    with pytest.raises(RuntimeError, match="wrote the API key into its report"):
        run_guidellm(fake_guidellm, _settings(tmp_path), "run", tmp_path, "k-123-secret", None, 60)
    assert not (tmp_path / "run.json").exists()
