"""One endpoint for the study, eval-model and serve: liveness beyond vLLM's ``/health``, API keys on every
call, endpoints without ``/metrics``, and one builder for chat request bodies.

The stand-in for NVIDIA NIM is the trivial server with NIM's liveness path, no ``/metrics`` and a required
bearer key; nothing here starts vLLM.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cartspec.bench.loadgen import LoadConfig, body_for, chat_requests, run_load
from cartspec.bench.metrics import scrape
from cartspec.bench.plan import SweepPlan
from cartspec.results import load_results, results_path
from cartspec.bench.sweep import run_sweep
from cartspec.serving.client import ChatClient, chat_body
from cartspec.serving.endpoint import EndpointError, MissingApiKey, endpoint
from cartspec.serving.spec import DeploymentSpec
from cartspec.task.data import Request
from cartspec.task.prompts import messages
from cartspec.task.schema import json_schema
from cartspec.testing.trivial_server import FakeConfig, TrivialServer

KEY = "nim-test-key-7f3a"  # long enough that finding it in a file is not a coincidence
MSG = [{"role": "user", "content": "red trail runners under $120"}]


def nim(**kw) -> FakeConfig:
    """NIM as the tools see it: ``/v1/health/ready`` (``/health`` is 404), no ``/metrics``, a bearer key."""
    return FakeConfig(**{"tokens": 6, "health_paths": ("/v1/health/ready",), "metrics": False, "api_key": KEY, **kw})


# --- liveness and keys ------------------------------------------------------------------


@pytest.mark.parametrize("paths, expected", [(("/health",), "/health"),
                                             (("/v1/health/ready",), "/v1/health/ready"),
                                             ((), "/v1/models")])
def test_a_url_is_alive_by_the_first_liveness_path_that_answers(tmp_path, paths, expected):
    with TrivialServer(FakeConfig(health_paths=paths)) as srv:
        with endpoint(srv.url + "/", log_dir=tmp_path) as ep:
            assert ep.url == srv.url and ep.served_name == "trivial"  # the first model it lists
            assert ep.alive() and ep.health_path == expected
            assert ep.alive() and ep.health_path == expected  # remembered, still right
            assert ep.server is None  # started nothing
        assert ep.alive()  # leaving the block stopped nothing: it was not ours
    assert not ep.alive()
    assert "stopped answering" in ep.died_reason() and expected in ep.died_reason()


def test_the_key_goes_on_every_call_and_never_into_what_is_recorded(tmp_path):
    with TrivialServer(nim()) as srv:
        with endpoint(srv.url, log_dir=tmp_path, api_key=KEY, runs=DeploymentSpec(model="served-by-nim"),
                      label="nim") as ep:
            assert ep.alive() and ep.health_path == "/v1/health/ready"
            assert ep.has_metrics is False  # 404: measured without acceptance figures
            info = ep.describe()
            assert ep.versions == {"server": "trivial"}
            assert asyncio.run(_healthy(ep.url, KEY))  # the agent's probe finds NIM's path too
        assert srv.counters.refused == []  # health, models, metrics, version: every call carried it
        assert (info.label, info.model, info.method, info.url) == ("nim", "trivial", "none", srv.url)
        assert KEY not in info.model_dump_json() and KEY not in repr(ep)


async def _healthy(url: str, key: str | None) -> bool:
    async with ChatClient(url, "trivial", api_key=key) as c:
        return await c.healthy()


def test_without_the_key_a_keyed_endpoint_says_it_is_unauthorised(tmp_path):
    with TrivialServer(nim()) as srv:
        with pytest.raises(EndpointError, match="401.*unauthorised"):
            with endpoint(srv.url, log_dir=tmp_path):  # the served name must come from /v1/models
                pass
        with endpoint(srv.url, log_dir=tmp_path, served_name="trivial") as ep:
            assert not ep.alive() and not ep.has_metrics
            reason = ep.died_reason()
        assert not asyncio.run(_healthy(srv.url, None))
    assert "refuses us" in reason and "HTTP 401" in reason and "unauthorised" in reason


def test_api_key_from_env_names_the_variable(monkeypatch):
    from cartspec.serving.endpoint import api_key_from_env

    monkeypatch.delenv("CARTSPEC_NO_SUCH_KEY", raising=False)
    with pytest.raises(MissingApiKey, match="CARTSPEC_NO_SUCH_KEY"):
        api_key_from_env("CARTSPEC_NO_SUCH_KEY")
    monkeypatch.setenv("CARTSPEC_NO_SUCH_KEY", f" {KEY}\n")
    assert api_key_from_env("CARTSPEC_NO_SUCH_KEY") == KEY and api_key_from_env(None) is None


# --- endpoints without /metrics ------------------------------------------------------------


@pytest.mark.parametrize("status, text", [(404, "not found"), (401, '{"error": "unauthorized"}'),
                                          (200, "<html>a gateway's login page</html>"),
                                          (200, 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="x"} 1')])
def test_a_missing_closed_or_foreign_metrics_page_gives_no_counters(status, text):
    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(status, text=text))
        async with httpx.AsyncClient(transport=transport) as http:
            return await scrape(http, "http://nim")

    counters = asyncio.run(go())
    assert counters is None or counters.stats() is None


def test_load_against_an_endpoint_without_metrics_has_no_acceptance_and_no_error():
    with TrivialServer(FakeConfig(tokens=5, metrics=False)) as srv:
        reqs = chat_requests([Request(id=f"q{i}", query=f"boots {i}") for i in range(4)], 16)
        res = asyncio.run(run_load(srv.url, "trivial", reqs, LoadConfig(concurrency=2, n_requests=4)))
    assert res.acceptance is None and len(res.records) == 4 and all(r.ok for r in res.records)


# --- the study against a keyed NIM -------------------------------------------------------------


def nim_plan(url: str, **kw) -> SweepPlan:
    return SweepPlan(**{"deployments": [DeploymentSpec(model="server")], "concurrencies": [1, 2], "n_requests": 4,
                        "warmup": 1, "max_tokens": 16, "server_url": url, **kw})


def test_the_study_measures_a_keyed_nim_endpoint_without_acceptance_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("NIM_API_KEY", KEY)
    with TrivialServer(nim()) as srv:
        results = run_sweep(nim_plan(srv.url), tmp_path, api_key_env="NIM_API_KEY")
    assert [r.status for r in results] == ["ok", "ok"], [r.reason for r in results]
    assert all(r.n_requests == 4 and r.n_errors == 0 and r.acceptance is None and r.acceptance_rate is None
               for r in results)
    assert srv.counters.refused == [] and srv.counters.requests == 2 * (4 + 1)
    assert results[0].deployment.model == "trivial"
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["invocations"][-1]["server_api_key_env"] == "NIM_API_KEY"
    for f in ("run.json", "results.jsonl"):  # the variable's name is recorded, the key never
        assert KEY not in (tmp_path / f).read_text()


@pytest.mark.parametrize("served_name", [None, "trivial"])
def test_without_the_key_the_study_records_its_points_failed_as_unauthorised(tmp_path, served_name):
    with TrivialServer(nim()) as srv:
        results = run_sweep(nim_plan(srv.url, served_name=served_name), tmp_path)
    assert [r.status for r in results] == ["failed", "failed"]
    for r in results:  # not started (models refused), or refused at its first point and every one after
        assert "401" in r.reason and "unauthorised" in r.reason, r.reason
    # refused at the first point (its warm-up and requests), and nothing sent for the second
    assert srv.counters.refused.count("/v1/chat/completions") <= 1 + 4
    assert len(load_results(tmp_path)) == 2 and results_path(tmp_path).exists()


def test_study_cli_with_server_api_key_env(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cartspec.cli import app

    args = ["study", "--server", "http://127.0.0.1:9", "--server-api-key-env", "CARTSPEC_TEST_NIM_KEY",
            "--out", str(tmp_path / "run"), "--concurrency", "1", "--requests", "2", "--warmup", "0"]
    monkeypatch.delenv("CARTSPEC_TEST_NIM_KEY", raising=False)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "CARTSPEC_TEST_NIM_KEY" in res.output, res.output
    assert not (tmp_path / "run").exists()  # nothing measured, nothing written
    monkeypatch.setenv("CARTSPEC_TEST_NIM_KEY", KEY)
    with TrivialServer(nim()) as srv:
        args[2] = srv.url
        res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert [r.status for r in load_results(tmp_path / "run")] == ["ok"] and srv.counters.refused == []
    assert KEY not in res.output


def test_eval_model_against_a_keyed_endpoint(tmp_path, monkeypatch):
    from cartspec.quality.structured import evaluate_model

    out = tmp_path / "eval.json"
    monkeypatch.delenv("CARTSPEC_TEST_NIM_KEY", raising=False)
    with pytest.raises(MissingApiKey, match="CARTSPEC_TEST_NIM_KEY"):
        evaluate_model(server="http://127.0.0.1:9", api_key_env="CARTSPEC_TEST_NIM_KEY", out=out)
    monkeypatch.setenv("CARTSPEC_TEST_NIM_KEY", KEY)
    reply = '{"intent": "search", "keywords": "boots"}'
    with TrivialServer(nim(reply=reply)) as srv:
        summary = evaluate_model(server=srv.url, served_name="trivial", api_key_env="CARTSPEC_TEST_NIM_KEY",
                                 limit=3, out=out, concurrency=2)
    assert summary["n"] == 3 and summary["n_request_errors"] == 0 and srv.counters.refused == []
    assert summary["meta"]["server_api_key_env"] == "CARTSPEC_TEST_NIM_KEY"
    assert KEY not in out.read_text() and KEY not in out.with_suffix(".replies.jsonl").read_text()


# --- one builder for chat bodies ----------------------------------------------------------


def test_chat_bodies_are_the_ones_the_old_code_sent():
    schema = json_schema("search")
    # ChatClient (the agent's upstream, eval-model): no streaming, the schema named "reply"
    assert chat_body("cartspec", MSG, max_tokens=64, temperature=0.0) == {
        "model": "cartspec", "messages": MSG, "max_tokens": 64, "temperature": 0.0}
    assert chat_body("cartspec", MSG, max_tokens=64, temperature=0.3, seed=7, json_schema=schema,
                     extra={"ignore_eos": True}) == {
        "model": "cartspec", "messages": MSG, "max_tokens": 64, "temperature": 0.3, "seed": 7,
        "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}},
        "ignore_eos": True}
    # the load generator: streaming with a usage chunk, the schema named after the task
    req = Request(id="q1", query="red boots under $80", task="search")
    plain, structured = chat_requests([req], 32)[0], chat_requests([req], 32, structured=True)[0]
    assert body_for("m", plain, 0.0, None) == {
        "model": "m", "messages": messages(req), "max_tokens": 32, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}}
    assert body_for("m", structured, 0.5, 11) == {
        "model": "m", "messages": messages(req), "max_tokens": 32, "temperature": 0.5, "stream": True,
        "stream_options": {"include_usage": True}, "seed": 11,
        "response_format": {"type": "json_schema", "json_schema": {"name": "search", "schema": schema}}}


def test_chat_client_sends_the_built_body_with_the_key():
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append((request.headers.get("authorization"), json.loads(request.content)))
        return httpx.Response(200, json={"choices": [{"message": {"content": "{}"}, "finish_reason": "stop"}],
                                         "usage": {"prompt_tokens": 3, "completion_tokens": 1}})

    async def go():
        client = ChatClient("http://nim", "cartspec", api_key=KEY)
        await client._http.aclose()  # the same client, over a transport that records what it is sent
        client._http = httpx.AsyncClient(base_url="http://nim", headers=dict(client._http.headers),
                                         transport=httpx.MockTransport(answer))
        async with client:
            return await client.chat(MSG, max_tokens=8, json_schema={"type": "object"}, seed=3)

    comp = asyncio.run(go())
    assert comp.text == "{}" and comp.output_tokens == 1
    assert sent == [(f"Bearer {KEY}", chat_body("cartspec", MSG, max_tokens=8, temperature=0.0, seed=3,
                                                json_schema={"type": "object"}))]


def test_a_served_name_that_could_not_be_a_specs_name_is_refused_before_anything_starts():
    from cartspec.serving.endpoint import endpoint
    from cartspec.serving.spec import DeploymentSpec

    started = []
    with pytest.raises(ValueError, match="is not a deployment name"):
        with endpoint(DeploymentSpec(), served_name="shop\n$(id)", launcher=lambda *a: started.append(a)):
            pass
    assert not started
