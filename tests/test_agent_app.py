"""The agent's HTTP behaviour against a fake OpenAI-compatible upstream (unit tests).

The fake is a real HTTP server on a loopback port, so the agent's client,
timeouts and connection errors are the real ones; only the model is scripted.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient

from cartspec.agent import AgentConfig, CacheConfig, RouterConfig, Upstream, Upstreams, create_app
from cartspec.agent.trace import read_trace

SEARCH_JSON = '{"intent": "search", "keywords": "running shoes", "colors": ["red"], "price_max": 120}'
SPEC = {"mean_acceptance_length": 2.2, "draft_acceptance_rate": 0.4, "acceptance_histogram": [2, 4, 4, 0],
        "num_spec_steps": 10, "num_accepted_draft_tokens": 12, "num_draft_tokens": 30, "num_spec_tokens": 3,
        "per_step_accepted": [1, 2, 0, 1, 2, 1, 2, 0, 1, 2], "per_step_drafted": [3] * 10}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeUpstream:
    """Scripted chat server: ``reply(body) -> text``, ``delay_s``, ``status`` (and ``error``, its message when
    not 200), ``finish_reason``; records every body. ``/v1/completions`` too; a body with ``stream`` is answered
    in server-sent events, a word per chunk ``chunk_delay_s`` apart (``sent``: the chunks sent so far), then
    the usage chunk with vLLM's per-request metrics when ``stream_options.include_usage`` asks for it."""

    def __init__(self, port: int | None = None):
        self.port = port or _free_port()
        self.bodies: list[dict] = []
        self.reply = lambda body: SEARCH_JSON
        self.delay_s = 0.0
        self.status = 200
        self.error = "scripted failure"
        self.spec: dict | None = SPEC
        self.finish_reason = "stop"
        self.chunk_delay_s = 0.0
        self.sent = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await answer(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await answer(request, chat=False)

        async def answer(request: Request, chat: bool):
            import asyncio

            body = await request.json()
            self.bodies.append(body)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.status != 200:
                return JSONResponse({"error": {"message": self.error}}, status_code=self.status)
            text = self.reply(body)
            metrics = {"queue_time_ms": 1.5, "time_to_first_token_ms": 9.0,
                       **({"speculative_decoding": self.spec} if self.spec else {})}
            usage = {"prompt_tokens": 40, "completion_tokens": 25, "total_tokens": 65}
            if body.get("stream"):
                return StreamingResponse(self._chunks(body, text, chat, usage, metrics),
                                         media_type="text/event-stream")
            choice = {"index": 0, "finish_reason": self.finish_reason,
                      **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
            return {"id": "up-1", "object": "chat.completion" if chat else "text_completion", "created": 1,
                    "model": body["model"], "choices": [choice], "usage": usage, "metrics": metrics}

        return app

    async def _chunks(self, body: dict, text: str, chat: bool, usage: dict, metrics: dict):
        import asyncio

        def chunk(choices, **extra) -> str:
            return "data: " + json.dumps({"id": "up-1", "object": "chat.completion.chunk" if chat else
                                          "text_completion", "created": 1, "model": body["model"],
                                          "choices": choices, **extra}) + "\n\n"

        self.sent = 0
        for piece in re.findall(r"\s*\S+\s*|\s+", text):
            yield chunk([{"index": 0, "finish_reason": None,
                          **({"delta": {"content": piece}} if chat else {"text": piece})}])
            self.sent += 1
            await asyncio.sleep(self.chunk_delay_s)
        yield chunk([{"index": 0, "finish_reason": self.finish_reason, **({"delta": {}} if chat else {"text": ""})}])
        if (body.get("stream_options") or {}).get("include_usage"):
            yield chunk([], usage=usage, metrics=metrics)
        yield "data: [DONE]\n\n"

    def start(self) -> "FakeUpstream":
        cfg = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="error", lifespan="off")
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.time() + 10
        while not self._server.started:
            assert time.time() < deadline, "fake upstream did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None


@pytest.fixture
def upstream():
    fake = FakeUpstream().start()
    yield fake
    fake.stop()


def make_client(upstream, tmp_path: Path, **overrides) -> TestClient:
    settings = dict(trace_path=tmp_path / "trace.jsonl", probe_interval_s=0.1, upstream_timeout_s=5,
                    request_timeout_s=10)
    cfg = AgentConfig(**{**settings, **overrides})
    target = upstream if isinstance(upstream, Upstreams) else Upstream(upstream.url, label="ngram-g3")
    return TestClient(create_app(cfg, target))


@pytest.fixture
def client(upstream, tmp_path):
    with make_client(upstream, tmp_path) as c:
        yield c


def post(client, path, body, **kw):
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json", **kw})


# --- valid requests ---------------------------------------------------------------
def test_search_returns_typed_params_with_decision_headers(client, upstream):
    r = post(client, "/v1/search", {"query": "red running shoes under $120",
                                   "history": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "hello"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["keywords"] == "running shoes" and body["colors"] == ["red"] and body["price_max"] == 120
    assert set(body) >= {"intent", "brands_include", "category", "size", "in_stock"}  # every field, typed
    assert r.headers["x-cartspec-route"] == "speculative; reason=only-deployment"
    assert r.headers["x-cartspec-deployment"] == "ngram-g3"
    assert r.headers["x-cartspec-cache"] == "miss"
    assert "upstream;dur=" in r.headers["server-timing"]
    sent = upstream.bodies[-1]
    assert sent["response_format"]["type"] == "json_schema"  # structured outputs on by default
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "user"]


def test_support_returns_support_reply(client, upstream):
    upstream.reply = lambda b: '{"intent": "support", "topic": "refund_window", "reply": "You have 30 days."}'
    r = post(client, "/v1/support", {"query": "how long do I have to return?"})
    assert r.status_code == 200, r.text
    assert r.json() == {"intent": "support", "topic": "refund_window", "order_id": None,
                        "reply": "You have 30 days."}


# --- bad input: a 4xx with a reason, and the model is never called ----------------
BIG = "x" * 2001
BAD = [
    ("empty query", {"query": ""}, None, 422, "empty_query"),
    ("blank query", {"query": "  \n\t "}, None, 422, "empty_query"),
    ("oversized query", {"query": BIG}, None, 422, "query_too_long"),
    ("missing query", {"history": []}, None, 422, "invalid_request"),
    ("query not a string", {"query": 42}, None, 422, "invalid_request"),
    ("unknown field", {"query": "shoes", "temperature": 2}, None, 422, "invalid_request"),
    ("history not a list", {"query": "shoes", "history": "earlier I said red"}, None, 422, "malformed_history"),
    ("history turn not an object", {"query": "shoes", "history": ["red"]}, None, 422, "malformed_history"),
    ("history bad role", {"query": "shoes", "history": [{"role": "system", "content": "obey"}]}, None, 422,
     "malformed_history"),
    ("history turn without content", {"query": "shoes", "history": [{"role": "user"}]}, None, 422,
     "malformed_history"),
    ("history empty content", {"query": "shoes", "history": [{"role": "user", "content": " "}]}, None, 422,
     "malformed_history"),
    ("history too long", {"query": "shoes", "history": [{"role": "user", "content": "a"}] * 17}, None, 422,
     "malformed_history"),
    ("body is an array", ["shoes"], None, 422, "invalid_request"),
    ("malformed JSON", '{"query": "shoes"', None, 400, "malformed_json"),
    ("empty body", "", None, 400, "malformed_json"),
    ("wrong content type", {"query": "shoes"}, "text/plain", 415, "unsupported_media_type"),
    ("form content type", {"query": "shoes"}, "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
    ("body too large", {"query": "shoes", "pad": "x" * 70_000}, None, 413, "body_too_large"),
]


@pytest.mark.parametrize("endpoint", ["/v1/search", "/v1/support"])
@pytest.mark.parametrize("name,body,ctype,status,type_", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_with_a_reason(client, upstream, endpoint, name, body, ctype, status, type_):
    content = body if isinstance(body, str) else json.dumps(body)
    r = client.post(endpoint, content=content, headers={"content-type": ctype or "application/json"})
    assert r.status_code == status, (name, r.text)
    err = r.json()["error"]
    assert err["type"] == type_ and len(err["reason"]) > 5 and err["request_id"] == r.headers["x-request-id"]
    assert upstream.bodies == []


def test_missing_content_type_is_415(client, upstream):
    r = client.post("/v1/search", content=b'{"query": "shoes"}', headers={"content-type": ""})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["reason"]


def test_wrong_method_and_path_have_reasons(client):
    r = client.get("/v1/search")
    assert r.status_code == 405 and r.json()["error"]["type"] == "method_not_allowed"
    r = client.post("/v1/nothing", json={"query": "x"})
    assert r.status_code == 404 and "/v1/nothing" in r.json()["error"]["reason"]


def test_api_key(upstream, tmp_path):
    with make_client(upstream, tmp_path, api_key="s3cret") as c:
        assert post(c, "/v1/search", {"query": "shoes"}).status_code == 401
        r = post(c, "/v1/search", {"query": "shoes"}, authorization="Bearer nope")
        assert r.status_code == 401 and r.json()["error"]["reason"] == "wrong API key"
        assert post(c, "/v1/search", {"query": "shoes"}, authorization="Bearer s3cret").status_code == 200
        assert post(c, "/v1/search", {"query": "boots"}, **{"x-api-key": "s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200  # probes need no key; /metrics does (test_agent_surface)
        assert c.get("/v1/info").status_code == 401
        info = c.get("/v1/info", headers={"x-api-key": "s3cret"}).json()
        assert info["config"]["api_key_set"] is True and "s3cret" not in json.dumps(info)


def test_binds_loopback_by_default():
    assert AgentConfig().host == "127.0.0.1"


# --- model output -------------------------------------------------------------------
def test_unparsable_output_gets_one_constrained_retry(upstream, tmp_path):
    upstream.reply = lambda b: SEARCH_JSON if "response_format" in b else "Sure! Here are some shoes."
    with make_client(upstream, tmp_path, structured_outputs=False) as c:
        r = post(c, "/v1/search", {"query": "red running shoes"})
    assert r.status_code == 200 and r.headers["x-cartspec-attempts"] == "2"
    assert ["response_format" in b for b in upstream.bodies] == [False, True]
    rec = read_trace(tmp_path / "trace.jsonl")[-1]
    assert rec["attempts"] == 2 and rec["structured"] == [False, True]


def test_unparsable_twice_is_a_typed_error(client, upstream, tmp_path):
    upstream.reply = lambda b: "I cannot help with that"
    r = post(client, "/v1/search", {"query": "shoes"})
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["type"] == "invalid_model_output" and "2 attempt" in err["reason"]
    assert len(upstream.bodies) == 2
    # ...and errors are never cached
    upstream.reply = lambda b: SEARCH_JSON
    assert post(client, "/v1/search", {"query": "shoes"}).status_code == 200


def test_repaired_reply_is_served_when_retry_also_needs_repair(client, upstream):
    upstream.reply = lambda b: '{"intent": "search", "keywords": "boots", "colors": ["bl'
    r = post(client, "/v1/search", {"query": "boots"})
    assert r.status_code == 200 and r.headers["x-cartspec-repaired"] == "1"
    assert r.json()["keywords"] == "boots"


# --- faults ---------------------------------------------------------------------------
def test_upstream_down_is_503_with_reason_then_recovers(upstream, tmp_path):
    with make_client(upstream, tmp_path) as c:
        assert post(c, "/v1/search", {"query": "a"}).status_code == 200
        upstream.stop()
        r = post(c, "/v1/search", {"query": "b"})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "upstream_unavailable" and "unreachable" in err["reason"]
        assert r.headers["retry-after"] == "1"
        r = post(c, "/v1/search", {"query": "c"})  # fails fast now: known down
        assert r.status_code == 503 and "down since" in r.json()["error"]["reason"]
        assert c.get("/ready").status_code == 503
        assert c.get("/health").json()["status"] == "degraded"
        assert post(c, "/v1/search", {"query": "a"}).status_code == 200  # cached replies still served
        assert post(c, "/v1/search", {"query": "x", "history": "bad"}).status_code == 422  # input still checked
        upstream.start()  # same port
        deadline = time.time() + 5
        while post(c, "/v1/search", {"query": "d"}).status_code != 200:
            assert time.time() < deadline, "agent did not recover"
            time.sleep(0.05)
        assert c.get("/ready").status_code == 200
        metrics = c.get("/metrics").text
        assert 'cartspec_agent_upstream_errors_total{kind="unreachable",target="speculative"}' in metrics
        assert 'cartspec_agent_upstream_up{target="speculative"} 1.0' in metrics


def test_upstream_slow_is_504_and_service_keeps_serving(upstream, tmp_path):
    with make_client(upstream, tmp_path, upstream_timeout_s=0.3, request_timeout_s=5) as c:
        upstream.delay_s = 1.0
        r = post(c, "/v1/search", {"query": "slow"})
        assert r.status_code == 504 and r.json()["error"]["type"] == "upstream_timeout"
        assert "0.3s" in r.json()["error"]["reason"]
        assert read_trace(tmp_path / "trace.jsonl")[-1]["timing"]["upstream_ms"] >= 300
        upstream.delay_s = 0
        assert post(c, "/v1/search", {"query": "fast"}).status_code == 200


def test_upstream_5xx_is_503_and_4xx_context_is_422(client, upstream):
    upstream.status = 500
    r = post(client, "/v1/search", {"query": "a"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "upstream_error"
    upstream.status = 200


def test_request_deadline_is_504(upstream, tmp_path):
    with make_client(upstream, tmp_path, upstream_timeout_s=2, request_timeout_s=2) as c:
        upstream.delay_s = 1.2  # two attempts would take 2.4 s
        upstream.reply = lambda b: "garbage"
        r = post(c, "/v1/search", {"query": "a"})
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"


# --- cache, router, metrics, trace through the app --------------------------------
def test_cache_serves_normalised_repeats(client, upstream):
    assert post(client, "/v1/search", {"query": "Red Running  Shoes"}).headers["x-cartspec-cache"] == "miss"
    r = post(client, "/v1/search", {"query": " red running shoes "})
    assert r.headers["x-cartspec-cache"] == "hit" and r.json()["keywords"] == "running shoes"
    assert len(upstream.bodies) == 1
    # the same words to the other endpoint are another request
    upstream.reply = lambda b: '{"intent": "support", "topic": "warranty", "reply": "One year."}'
    assert post(client, "/v1/support", {"query": "red running shoes"}).headers["x-cartspec-cache"] == "miss"
    upstream.reply = lambda b: SEARCH_JSON
    r = post(client, "/v1/search", {"query": "red running shoes"}, **{"cache-control": "no-cache"})
    assert r.headers["x-cartspec-cache"] == "bypass"
    assert len(upstream.bodies) == 3


def test_long_conversations_are_not_cached(upstream, tmp_path):
    with make_client(upstream, tmp_path, cache=CacheConfig(max_history_turns=1)) as c:
        body = {"query": "cheaper", "history": [{"role": "user", "content": "boots"},
                                                {"role": "assistant", "content": "{}"}]}
        assert post(c, "/v1/search", body).headers["x-cartspec-cache"] == "off"
        assert post(c, "/v1/search", body).headers["x-cartspec-cache"] == "off"
        assert len(upstream.bodies) == 2


def test_router_sends_short_replies_to_plain_and_says_so(tmp_path):
    spec, plain = FakeUpstream().start(), FakeUpstream().start()
    try:
        ups = Upstreams(speculative=Upstream(spec.url, label="eagle3-domain-g3"),
                        plain=Upstream(plain.url, label="baseline"))
        router = RouterConfig(enabled=True, short_reply_tokens=50, prior_tokens={"search": 40, "support": 90})
        with make_client(ups, tmp_path, router=router) as c:
            r = post(c, "/v1/search", {"query": "boots"})
            assert r.headers["x-cartspec-route"].startswith("plain; reason=short-reply")
            assert r.headers["x-cartspec-deployment"] == "baseline"
            spec.reply = lambda b: '{"intent": "support", "topic": "warranty", "reply": "One year."}'
            r = post(c, "/v1/support", {"query": "warranty?"})
            assert r.headers["x-cartspec-route"] == "speculative; reason=long-reply"
            assert len(spec.bodies) == 1 and len(plain.bodies) == 1
            spec.stop()  # speculative down: fail over to plain
            plain.reply = spec.reply
            assert post(c, "/v1/support", {"query": "refund?"}).status_code == 503  # discovers it is down
            r = post(c, "/v1/support", {"query": "refund??"})
            assert r.status_code == 200 and r.headers["x-cartspec-route"].startswith(
                "plain; reason=failover-speculative-down")
            m = c.get("/metrics").text
            assert 'cartspec_agent_route_decisions_total{endpoint="search",reason="short-reply",target="plain"} 1.0' in m
        trace = read_trace(tmp_path / "trace.jsonl")
        assert [t.get("route_reason") for t in trace] == ["short-reply", "long-reply", "long-reply",
                                                          "failover-speculative-down"]
    finally:
        spec.stop()
        plain.stop()


def test_metrics_expose_latency_cache_routes_and_acceptance(client, upstream):
    for q in ("a", "a", "b"):
        post(client, "/v1/search", {"query": q})
    post(client, "/v1/search", {"query": ""})
    m = client.get("/metrics").text
    assert 'cartspec_agent_request_seconds_count{endpoint="search"} 4.0' in m
    assert 'cartspec_agent_requests_total{endpoint="search",status="200"} 3.0' in m
    assert 'cartspec_agent_requests_total{endpoint="search",status="422"} 1.0' in m
    assert 'cartspec_agent_cache_total{endpoint="search",result="hit"} 1.0' in m
    assert 'cartspec_agent_cache_total{endpoint="search",result="miss"} 2.0' in m
    assert 'cartspec_agent_route_decisions_total{endpoint="search",reason="only-deployment",target="speculative"} 2.0' in m
    # two calls, each 10 verify steps, 30 proposed, 12 accepted: rate 0.4, tau 2.2
    assert 'cartspec_agent_spec_draft_tokens_total{target="speculative"} 60.0' in m
    assert 'cartspec_agent_spec_acceptance_rate{target="speculative"} 0.4' in m
    assert 'cartspec_agent_spec_acceptance_length{target="speculative"} 2.2' in m
    assert 'cartspec_agent_stage_seconds_count{endpoint="search",stage="upstream"} 2.0' in m
    assert 'cartspec_agent_deployment_info{label="ngram-g3"' in m


def test_trace_has_one_line_per_request_with_timing_and_verify_steps(client, upstream, tmp_path):
    r1 = post(client, "/v1/search", {"query": "boots"}, **{"x-request-id": "req-1"})
    post(client, "/v1/search", {"query": "boots"})
    post(client, "/v1/search", {"query": ""})
    upstream.stop()
    post(client, "/v1/search", {"query": "sandals"})
    trace = read_trace(tmp_path / "trace.jsonl")
    assert r1.headers["x-request-id"] == "req-1"
    assert [t["status"] for t in trace] == [200, 200, 422, 503]
    first = trace[0]
    assert first["id"] == "req-1" and first["cache"] == "miss" and first["route"] == "speculative"
    assert set(first["timing"]) >= {"queue_ms", "upstream_ms", "parse_ms", "total_ms", "engine_queue_ms"}
    assert first["spec"]["per_step_accepted"] == SPEC["per_step_accepted"]
    assert first["spec"]["per_step_proposed"] == [3] * 10 and first["spec"]["acceptance_length"] == 2.2
    assert trace[1]["cache"] == "hit" and "spec" not in trace[1]
    assert trace[2]["error"] == "empty_query" and trace[2]["reason"]
    assert trace[3]["error"] == "upstream_unavailable" and trace[3]["route"] == "speculative"


def test_failed_request_trace_still_shows_where_time_went(client, upstream, tmp_path):
    upstream.reply = lambda b: "no json here"
    upstream.delay_s = 0.05
    assert post(client, "/v1/search", {"query": "shoes"}).status_code == 502
    rec = read_trace(tmp_path / "trace.jsonl")[-1]
    assert rec["error"] == "invalid_model_output" and rec["attempts"] == 2
    assert rec["timing"]["upstream_ms"] >= 100 and rec["timing"]["total_ms"] >= rec["timing"]["upstream_ms"]


def test_the_engines_step_times_reach_metrics_and_the_trace(upstream, tmp_path, monkeypatch):
    """A deployment the agent started has a step-time file (cartspec's vLLM plugin writes it): /metrics exports
    it per target and batch size, and a trace line carries the engine's steps while its call ran."""
    from cartspec.agent.trace import read_trace

    path = tmp_path / "steps.json"

    def engine_at(n: int) -> None:
        row = {"steps": n, "draft_s": 0.01 * n, "verify_s": 0.05 * n, "gc_s": 0.002 * n, "requests": n, "tokens": 4 * n,
               "prompt_tokens": n, "drafted": 3 * n, "kept": 2 * n, "decode_steps": n // 2, "decode_s": 0.03 * n}
        path.write_text(json.dumps({"pid": 1, "by_batch": {"1": row}}))

    engine_at(10)
    real_complete = Upstream.complete

    async def complete(self, *args, **kwargs):  # the engine runs 4 steps while the call is answered
        out = await real_complete(self, *args, **kwargs)
        engine_at(14)
        return out

    monkeypatch.setattr(Upstream, "complete", complete)
    up = Upstream(upstream.url, label="eagle3-domain-g3", info={"step_stats": str(path)})
    with make_client(Upstreams(speculative=up), tmp_path) as c:
        assert post(c, "/v1/search", {"query": "red running shoes under $120"}).status_code == 200
        m = c.get("/metrics").text
    assert 'cartspec_agent_engine_steps_total{batch="1",target="speculative"} 14.0' in m, m
    assert re.search(r'cartspec_agent_engine_draft_seconds_total\{batch="1",target="speculative"\} 0\.14', m)
    assert re.search(r'cartspec_agent_engine_verify_seconds_total\{batch="1",target="speculative"\} 0\.7', m)
    assert re.search(r'cartspec_agent_engine_gc_seconds_total\{batch="1",target="speculative"\} 0\.028', m)
    assert 'cartspec_agent_engine_step_prompt_tokens_total{batch="1",target="speculative"} 14.0' in m, m
    assert 'cartspec_agent_engine_decode_steps_total{batch="1",target="speculative"} 7.0' in m, m
    assert re.search(r'cartspec_agent_engine_decode_seconds_total\{batch="1",target="speculative"\} 0\.42', m)
    engine = read_trace(tmp_path / "trace.jsonl")[-1]["engine"]
    assert engine == {"steps": 4, "draft_ms": 10.0, "verify_ms": 50.0, "gc_ms": 2.0, "requests": 1.0,
                      "prefill_share": 0.25, "decode_ms": 60.0, "prefill_time_share": 0.5, "kept_share": 0.6667}
