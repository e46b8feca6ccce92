"""The agent's OpenAI-compatible API, driven by the real ``openai`` SDK against scripted upstreams.

The agent runs under uvicorn on a loopback port (so streams are real HTTP streams) in front of
``test_agent_app.FakeUpstream``, a real HTTP server whose replies, chunk pace and speculative counts are scripted.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from cartspec.agent import AgentConfig, CacheConfig, FallbackConfig, Upstream, Upstreams, create_app
from cartspec.agent.config import CanaryConfig
from cartspec.agent.trace import read_trace
from cartspec.task.traffic import TrafficConfig, dedupe, read_traffic
from test_agent_app import SEARCH_JSON, SPEC, FakeUpstream, upstream  # noqa: F401 (a fixture)

KEY = "agent-key-0123456789"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
          "required": ["city", "days"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
SECRET = "my card is 4111 1111 1111 1111, mail jane.doe@example.com"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app):
    """``app`` under uvicorn on a free loopback port, in a thread: its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "agent did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(15)


def config(tmp_path: Path, **kw) -> AgentConfig:
    return AgentConfig(**{"trace_path": tmp_path / "trace.jsonl", "probe_interval_s": 0.1, "upstream_timeout_s": 5,
                          "request_timeout_s": 10, **kw})


@contextlib.contextmanager
def sdk(tmp_path: Path, upstreams, **kw):
    """An ``openai.OpenAI`` client on an agent in front of ``upstreams`` (no retries: each call is one request)."""
    target = upstreams if isinstance(upstreams, (Upstreams, Upstream)) else Upstream(upstreams.url, label="schema-g3")
    app = create_app(config(tmp_path, **kw), target)
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=kw.get("api_key") or "unused", max_retries=0)
        client.agent_url = url
        yield client


@pytest.fixture
def client(upstream, tmp_path):
    with sdk(tmp_path, upstream) as c:
        yield c


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --- answers ----------------------------------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    [model] = client.models.list().data
    assert model.id == "cartspec" and model.object == "model" and model.owned_by == "cartspec"


def test_a_chat_completion_sends_the_clients_messages_as_they_are(client, upstream):
    upstream.reply = lambda body: "Hello! How can I help?"
    messages = [{"role": "system", "content": "You are terse."}, *user("hi there")]
    raw = client.chat.completions.with_raw_response.create(model="cartspec", messages=messages, max_tokens=20,
                                                           temperature=0.3, top_p=0.9, seed=7, stop=["\n\n"])
    r = raw.parse()
    assert isinstance(r, openai.types.chat.ChatCompletion)
    assert r.choices[0].message.content == "Hello! How can I help?" and r.choices[0].finish_reason == "stop"
    assert r.model == "cartspec" and r.usage.prompt_tokens == 40 and r.usage.completion_tokens == 25
    assert raw.headers["x-cartspec-route"] == "speculative; reason=only-deployment"
    sent = upstream.bodies[-1]
    assert sent["messages"] == messages  # no commerce prompt: the client's own
    assert (sent["max_tokens"], sent["temperature"], sent["top_p"], sent["seed"], sent["stop"]) == \
        (20, 0.3, 0.9, 7, ["\n\n"])
    assert "response_format" not in sent and not sent.get("stream")


def test_max_completion_tokens_and_text_parts_are_read(client, upstream):
    client.chat.completions.create(model="cartspec", max_completion_tokens=12,
                                   messages=[{"role": "user", "content": [{"type": "text", "text": "a "},
                                                                          {"type": "text", "text": "b"}]}])
    assert upstream.bodies[-1]["max_tokens"] == 12 and upstream.bodies[-1]["messages"] == user("a b")


def test_a_completion(client, upstream):
    upstream.reply = lambda body: " world"
    r = client.completions.create(model="cartspec", prompt="hello", max_tokens=5, temperature=0)
    assert isinstance(r, openai.types.Completion) and r.choices[0].text == " world"
    assert upstream.bodies[-1]["prompt"] == "hello" and "messages" not in upstream.bodies[-1]
    chunks = list(client.completions.create(model="cartspec", prompt="hello", max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " world"


# --- streaming ----------------------------------------------------------------------------------------------------
def test_a_stream_relays_each_chunk_as_the_upstream_sends_it(client, upstream, tmp_path):
    words = [f"w{i} " for i in range(10)]
    upstream.reply = lambda body: "".join(words)
    upstream.chunk_delay_s = 0.15
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model="cartspec", messages=user("count"), stream=True,
                                            stream_options={"include_usage": True})
    arrivals, pieces, usage = [], [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append((time.perf_counter() - t0, upstream.sent))
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces) == "".join(words)
    first_at, sent_then = arrivals[0]
    assert sent_then < len(words) and first_at < 0.15 * len(words) / 2  # long before the upstream finished
    assert arrivals[-1][0] - first_at >= 0.15 * (len(words) - 2)  # the gaps between tokens are kept
    assert usage.completion_tokens == 25
    rec = read_trace(tmp_path / "trace.jsonl")[-1]
    assert rec["endpoint"] == "chat" and rec["status"] == 200 and rec["timing"]["ttft_ms"] < 1000
    assert rec["spec"]["proposed"] == 30 and rec["spec"]["accepted"] == 12 and rec["spec"]["acceptance_length"] == 2.2
    sent = upstream.bodies[-1]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


def test_a_stream_without_include_usage_has_no_usage_chunk_but_still_traces_the_counts(client, upstream, tmp_path):
    chunks = list(client.chat.completions.create(model="cartspec", messages=user("hi"), stream=True))
    assert all(c.usage is None and c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop" and {c.model for c in chunks} == {"cartspec"}
    assert upstream.bodies[-1]["stream_options"] == {"include_usage": True}  # the agent asks for vLLM's counts
    assert read_trace(tmp_path / "trace.jsonl")[-1]["spec"]["drafts"] == 10


# --- JSON schema ----------------------------------------------------------------------------------------------------
def test_a_json_schema_is_sent_as_structured_output_and_the_reply_validated(client, upstream, tmp_path):
    upstream.reply = lambda body: '{"city": "Lisbon", "days": 3}'
    r = client.chat.completions.create(model="cartspec", messages=user("plan a trip"), response_format=FORMAT)
    assert json.loads(r.choices[0].message.content) == {"city": "Lisbon", "days": 3}
    # as sent: vLLM's structured output, and the schema the schema drafter reads inside vLLM
    assert upstream.bodies[-1]["response_format"] == FORMAT
    assert read_trace(tmp_path / "trace.jsonl")[-1]["attempts"] == 1


def test_an_invalid_reply_is_retried_constrained_at_temperature_0(client, upstream, tmp_path):
    replies = iter(['{"city": "Lisbon", "days": 0}', '{"city": "Lisbon", "days": 2}'])  # days < minimum, then ok
    upstream.reply = lambda body: next(replies)
    r = client.chat.completions.create(model="cartspec", messages=user("trip"), response_format=FORMAT,
                                       temperature=0.8)
    assert json.loads(r.choices[0].message.content)["days"] == 2
    assert [b["temperature"] for b in upstream.bodies] == [0.8, 0.0]
    assert all(b["response_format"] == FORMAT for b in upstream.bodies)
    rec = read_trace(tmp_path / "trace.jsonl")[-1]
    assert rec["attempts"] == 2 and rec["structured"] == [True, True]


def test_a_reply_never_valid_is_a_server_error_that_says_why(client, upstream):
    upstream.reply = lambda body: '{"city": "Lisbon"}'
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model="cartspec", messages=user("trip"), response_format=FORMAT)
    err = exc.value.body
    assert exc.value.status_code == 502 and err["code"] == "invalid_model_output" and err["type"] == "server_error"
    assert "fails 'required'" in err["message"] and len(upstream.bodies) == 2


def test_a_reply_cut_at_the_clients_max_tokens_is_returned_with_finish_reason_length(client, upstream):
    upstream.reply, upstream.finish_reason = (lambda body: '{"city": "Lis'), "length"
    r = client.chat.completions.create(model="cartspec", messages=user("trip"), response_format=FORMAT, max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == '{"city": "Lis'
    assert len(upstream.bodies) == 1  # a retry at the same budget would be cut again


def test_json_object_asks_for_one_object(client, upstream):
    upstream.reply = lambda body: '{"ok": true}'
    r = client.chat.completions.create(model="cartspec", messages=user("json"), response_format={"type": "json_object"})
    assert r.choices[0].message.content == '{"ok": true}'
    assert upstream.bodies[-1]["response_format"] == {"type": "json_object"}


def test_a_streamed_reply_that_breaks_its_schema_ends_with_an_error_event(client, upstream, tmp_path):
    upstream.reply = lambda body: '{"city": "Lisbon", "days": -1}'
    seen = []
    with pytest.raises(openai.APIError) as exc:
        for chunk in client.chat.completions.create(model="cartspec", messages=user("trip"), response_format=FORMAT,
                                                    stream=True):
            seen.append(chunk.choices[0].delta.content or "")
    assert "".join(seen) == '{"city": "Lisbon", "days": -1}'  # the reply was relayed as it came
    assert exc.value.body["code"] == "invalid_model_output" and "/days" in exc.value.body["message"]
    rec = read_trace(tmp_path / "trace.jsonl")[-1]
    assert rec["status"] == 502 and rec["error"] == "invalid_model_output"


# --- errors in OpenAI's shape --------------------------------------------------------------------------------------
BAD = [
    ("no messages", dict(messages=[]), "messages"),
    ("two choices", dict(messages=user(SECRET), n=2), "n"),
    ("tools", dict(messages=user(SECRET), tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ("temperature 3", dict(messages=user(SECRET), temperature=3), "temperature"),
    ("a control character", dict(messages=user(SECRET + "\x07")), "messages.0.content"),
    ("not a JSON schema", dict(messages=user(SECRET), response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "response_format.json_schema.schema"),
    ("a schema the grammar cannot compile", dict(messages=user(SECRET), response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}),
     "response_format.json_schema.schema"),
    ("json_schema without a schema", dict(messages=user(SECRET), response_format={"type": "json_schema"}),
     "response_format.json_schema"),
]


@pytest.mark.parametrize("name,kw,param", BAD, ids=[b[0] for b in BAD])
def test_a_malformed_request_is_a_400_in_openais_shape_that_quotes_nothing(client, upstream, tmp_path, name, kw, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="cartspec", **kw)
    err = exc.value.body
    assert set(err) >= {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and len(err["message"]) > 10, err
    assert SECRET not in json.dumps(err) and "4111" not in err["message"]
    assert SECRET not in (tmp_path / "trace.jsonl").read_text()
    assert upstream.bodies == []


def test_the_grammar_reason_names_what_it_cannot_compile(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="cartspec", messages=user("x"), response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}})
    assert exc.value.body["code"] == "invalid_json_schema" and "Lookbehind" in exc.value.body["message"]


def test_an_unknown_model_is_a_404_naming_the_served_one(client, upstream):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=user("hi"))
    assert exc.value.body["code"] == "model_not_found" and "'cartspec'" in exc.value.body["message"]
    assert upstream.bodies == []


def test_the_api_key_is_required_on_every_openai_endpoint(upstream, tmp_path):
    with sdk(tmp_path, upstream, api_key=KEY) as good:
        assert good.chat.completions.create(model="cartspec", messages=user("hi")).choices
        bad = openai.OpenAI(base_url=good.base_url, api_key="wrong", max_retries=0)
        for call in (lambda: bad.models.list(), lambda: bad.completions.create(model="cartspec", prompt="x"),
                     lambda: bad.chat.completions.create(model="cartspec", messages=user("hi"), stream=True)):
            with pytest.raises(openai.AuthenticationError) as exc:
                call()
            assert exc.value.body["type"] == "authentication_error"
    assert len(upstream.bodies) == 1


def test_a_deployment_refusal_is_a_400_and_a_context_overflow_says_so(client, upstream):
    upstream.status, upstream.error = 400, "This model's maximum context length is 1024 tokens. However, ..."
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="cartspec", messages=user("long"))
    assert exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:  # before the first chunk: a status, not an event
        client.chat.completions.create(model="cartspec", messages=user("long"), stream=True)
    assert exc.value.body["code"] == "context_length_exceeded"


def test_a_deployment_that_is_down_is_a_503_with_retry_after(upstream, tmp_path):
    with sdk(tmp_path, upstream) as c:
        upstream.stop()
        with pytest.raises(openai.InternalServerError) as exc:
            c.chat.completions.create(model="cartspec", messages=user("hi"))
        assert exc.value.status_code == 503 and exc.value.response.headers["retry-after"]
        assert exc.value.body["code"] == "upstream_unavailable"


def test_wrong_method_on_an_openai_path_has_openais_shape(client):
    r = httpx.get(client.agent_url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["code"] == "method_not_allowed"


# --- the agent's features on this path -------------------------------------------------------------------------
def test_chat_and_completions_are_recorded_redacted_and_readable_by_refresh(upstream, tmp_path):
    traffic = tmp_path / "traffic"
    upstream.reply = lambda body: "We will write to jane.doe@example.com."
    with sdk(tmp_path, upstream, traffic=TrafficConfig(dir=traffic)) as c:
        c.chat.completions.create(model="cartspec", messages=[{"role": "system", "content": "Be brief."},
                                                              *user(SECRET)])
        for _ in c.chat.completions.create(model="cartspec", messages=user(SECRET), stream=True):
            pass
        c.completions.create(model="cartspec", prompt=SECRET)
        time.sleep(0.3)  # recorded after the response
    records = read_traffic(traffic)
    assert [r.task for r in records] == ["chat", "chat", "completion"]
    text = (traffic / next(p.name for p in traffic.iterdir())).read_text()
    assert "4111" not in text and "jane.doe@example.com" not in text and records[0].redactions >= 3
    chat = records[0]
    assert [m["role"] for m in chat.messages] == ["system", "user"] and chat.query == ""
    assert chat.reply.startswith("We will write to ") and chat.proposed == 30 and chat.accepted == 12
    assert records[1].messages == [{"role": "user", "content": records[0].messages[1]["content"]}]
    assert records[2].messages == [] and records[2].query != SECRET and "4111" not in records[2].query
    assert len(dedupe(records)) == 3  # two chats with other messages are two requests

    from cartspec.draft.refresh import load_traffic

    split = load_traffic(traffic, 0.5, min_records=1)  # draft refresh trains on chat turns, not raw prompts
    assert {r.task for r in split.train + split.held_out} == {"chat"}


def test_chat_falls_back_to_plain_when_the_draft_stops_paying(tmp_path):
    spec_fake, plain_fake = FakeUpstream().start(), FakeUpstream().start()
    spec_fake.spec = {"num_spec_steps": 10, "num_draft_tokens": 30, "num_accepted_draft_tokens": 1}
    plain_fake.spec = None
    try:
        ups = Upstreams(speculative=Upstream(spec_fake.url, label="eagle3-generic-g3"),
                        plain=Upstream(plain_fake.url, label="baseline"))
        fallback = FallbackConfig(threshold=0.3, recover_threshold=0.5, window_requests=4, min_requests=3,
                                  probe_share=0.5)
        with sdk(tmp_path, ups, fallback=fallback) as c:
            routes = []
            for i in range(5):
                stream = i % 2 == 1
                raw = c.chat.completions.with_raw_response.create(model="cartspec", messages=user(f"q {i}"),
                                                                  stream=stream)
                if stream:
                    list(raw.parse())
                routes.append(raw.headers["x-cartspec-route"])
            assert routes[:3] == ["speculative; reason=router-off"] * 3
            assert routes[3] == "plain; reason=acceptance-fallback; acceptance=0.033"
            assert routes[4].startswith("speculative; reason=acceptance-probe")
            m = httpx.get(c.agent_url + "/metrics").text
            assert 'cartspec_agent_fallback_switches_total{direction="to_fallback",target="speculative"} 1.0' in m
            assert 'cartspec_agent_requests_total{endpoint="chat",status="200"} 5.0' in m
        assert len(plain_fake.bodies) == 1 and len(spec_fake.bodies) == 4
    finally:
        spec_fake.stop()
        plain_fake.stop()


def test_chat_goes_through_the_canary(tmp_path):
    cur, cand = FakeUpstream().start(), FakeUpstream().start()
    cur.spec = {"num_spec_steps": 10, "num_draft_tokens": 30, "num_accepted_draft_tokens": 12}
    cand.spec = {"num_spec_steps": 10, "num_draft_tokens": 30, "num_accepted_draft_tokens": 24}
    try:
        ups = Upstreams(speculative=Upstream(cur.url, label="eagle3-cur-g3"),
                        candidate=Upstream(cand.url, label="eagle3-cand-g3"))
        trial = CanaryConfig(share=0.25, min_requests=4, min_rollback_requests=4, window_requests=8, registry=False)
        with sdk(tmp_path, ups, canary=trial) as c:
            heads = []
            for i in range(20):
                raw = c.chat.completions.with_raw_response.create(model="cartspec", messages=user(f"q {i}"),
                                                                  stream=i % 2 == 0)
                if i % 2 == 0:
                    list(raw.parse())
                heads.append(raw.headers["x-cartspec-route"])
            assert heads[3] == "candidate; reason=canary" and heads[:3] == ["speculative; reason=only-deployment"] * 3
            assert heads[-1] == "candidate; reason=canary-promoted"
            m = httpx.get(c.agent_url + "/metrics").text
            assert 'cartspec_canary_decisions_total{decision="promote"} 1.0' in m
        trace = read_trace(tmp_path / "trace.jsonl")
        assert trace[3]["canary"]["arm"] == "candidate" and trace[0]["canary"]["arm"] == "current"
        assert any(t["canary"].get("decision") == "promote" for t in trace)
    finally:
        cur.stop()
        cand.stop()


def test_the_cache_is_opt_in_for_openai_requests(upstream, tmp_path):
    for opted, expected in ((False, ["off", "off"]), (True, ["miss", "hit"])):
        upstream.bodies.clear()
        with sdk(tmp_path, upstream, cache=CacheConfig(openai=opted)) as c:
            heads = [c.chat.completions.with_raw_response.create(model="cartspec", messages=user("same"),
                                                                 temperature=0).headers["x-cartspec-cache"]
                     for _ in range(2)]
            assert heads == expected
            sampled = c.chat.completions.with_raw_response.create(model="cartspec", messages=user("same"))
            assert sampled.headers["x-cartspec-cache"] == "off"  # temperature 1: a new sample every time
        assert len(upstream.bodies) == (3 if not opted else 2)


def test_the_commerce_endpoints_take_the_same_path(upstream, tmp_path):
    """/v1/search is a chat call with the task's messages and schema: the upstream sees what a client of
    /v1/chat/completions sending them would have sent, and both are traced alike."""
    upstream.reply = lambda body: SEARCH_JSON
    with sdk(tmp_path, upstream) as c:
        r = httpx.post(c.agent_url + "/v1/search", json={"query": "red running shoes"})
        assert r.status_code == 200 and r.json()["keywords"] == "running shoes"
        commerce = upstream.bodies[-1]
        c.chat.completions.create(model="cartspec", messages=commerce["messages"], max_tokens=commerce["max_tokens"],
                                  temperature=commerce["temperature"], response_format=commerce["response_format"])
        assert upstream.bodies[-1] == commerce
    search, chat = read_trace(tmp_path / "trace.jsonl")
    assert (search["endpoint"], chat["endpoint"]) == ("search", "chat")
    assert search["spec"] == chat["spec"] and search["structured"] == chat["structured"] == [True]


def test_admission_refuses_a_chat_that_would_wait_too_long(upstream, tmp_path):
    from cartspec.agent.config import AdmissionConfig

    upstream.delay_s = 0.3
    adm = AdmissionConfig(enabled=True, max_wait_s=0.05, min_completions=2, window_completions=4)
    with sdk(tmp_path, upstream, admission=adm) as c:
        for i in range(2):  # measured: about 3 completions a second
            c.chat.completions.create(model="cartspec", messages=user(f"warm {i}"))
        busy = threading.Thread(target=lambda: c.chat.completions.create(model="cartspec", messages=user("busy")))
        busy.start()
        time.sleep(0.1)
        with pytest.raises(openai.InternalServerError) as exc:
            c.chat.completions.create(model="cartspec", messages=user("late"))
        busy.join()
    assert exc.value.status_code == 503 and exc.value.body["code"] == "overloaded"
    assert exc.value.response.headers["retry-after"]


def test_the_spec_counts_in_the_trace_match_vllms(client, upstream, tmp_path):
    client.chat.completions.create(model="cartspec", messages=user("hi"))
    rec = read_trace(tmp_path / "trace.jsonl")[-1]
    assert rec["spec"]["per_step_accepted"] == SPEC["per_step_accepted"] and rec["route"] == "speculative"
    assert rec["deployment"] == "schema-g3" and rec["timing"]["engine_queue_ms"] == 1.5


# --- a real engine ------------------------------------------------------------------------------------------------
@pytest.mark.vllm
def test_the_sdk_on_a_users_model_without_a_head_streams_and_drafts_from_the_requests_schema(tiny_llama_dir,
                                                                                            tmp_path):
    """What `cartspec serve --model DIR` runs for a model no head was trained for: the schema drafter, the
    agent in front. The SDK streams a reply under a JSON schema of its own; vLLM constrains it and the schema
    drafter drafts from that schema (its forced tokens are accepted), with no commerce prompt anywhere."""
    from cartspec.serving.server import VllmServer
    from cartspec.serving.spec import DeploymentSpec, Speculative

    compact = ["--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
    spec = DeploymentSpec(model=str(tiny_llama_dir), enforce_eager=True, max_num_seqs=4, max_model_len=1024,
                          speculative=Speculative(method="schema", num_speculative_tokens=3),
                          engine_args=["--enable-per-request-metrics", *compact], start_timeout_s=300)
    with VllmServer(spec, log_dir=tmp_path) as server:
        up = Upstream(server.url, model=spec.name, label=spec.label, api_key=server.api_key)
        with sdk(tmp_path, up) as c:
            stream = c.chat.completions.create(model="cartspec", messages=user("plan a trip"), response_format=FORMAT,
                                               max_tokens=64, temperature=0, stream=True,
                                               stream_options={"include_usage": True})
            chunks = list(stream)
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            finish = next(ch.choices[0].finish_reason for ch in reversed(chunks) if ch.choices)
            assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) > 1  # streamed, not one blob
            assert text.startswith('{"city":"') and chunks[-1].usage.completion_tokens > 0  # under the schema
            if finish == "stop":  # closed under the schema: valid (else cut at max_tokens, finish_reason says so)
                assert set(json.loads(text)) == {"city", "days"}
            r = c.chat.completions.create(model="cartspec", messages=user("hello"), max_tokens=8, temperature=0)
            assert r.choices[0].message.content and r.usage.completion_tokens > 0  # free text, no schema
    schema_call, free_call = read_trace(tmp_path / "trace.jsonl")
    assert schema_call["endpoint"] == "chat" and schema_call["status"] == 200 and schema_call["structured"] == [True]
    assert schema_call["spec"]["proposed"] > 0 and schema_call["spec"]["accepted"] > 0  # drafted from the schema
    assert schema_call["timing"]["ttft_ms"] > 0 and free_call["status"] == 200
