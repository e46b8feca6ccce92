"""Every bad input to the agent is a 4xx with a reason, and no error quotes the request.

Schemathesis generates requests from the agent's own OpenAPI schema, ones that fit it and ones that break it,
against a scripted upstream. Explicit cases add what a schema does not generate: deep JSON, huge numbers, lone
surrogates, control characters, oversized histories, and limits raised past what the model takes.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from pydantic import ValidationError
from schemathesis.checks import not_a_server_error
from schemathesis.python.asgi import shutdown_lifespans

from cartspec.agent import AgentConfig, Upstream, create_app
from cartspec.agent.trace import TraceWriter, read_trace
from test_agent_app import SEARCH_JSON, FakeUpstream, make_client, upstream  # noqa: F401 (a fixture)

SUPPORT_JSON = '{"intent": "support", "topic": "refund_window", "reply": "You have 30 days."}'
SECRET = "my card is 4111 1111 1111 1111, order AB12345"  # request text no error may quote
EXAMPLES = 40  # per operation and generation mode: about 15 s on 2 cores


def scripted_reply(body: dict) -> str:
    """A valid reply for whichever task the agent asked for (its schema names the fields)."""
    schema = (body.get("response_format") or {}).get("json_schema", {}).get("schema", {})
    return SUPPORT_JSON if "topic" in schema.get("properties", {}) else SEARCH_JSON


class LogLines(logging.Handler):
    """Every line the agent logs, tracebacks included, as the log file would hold it."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def agent_log():
    handler, log = LogLines(), logging.getLogger("cartspec.agent")
    log.addHandler(handler)
    yield handler
    log.removeHandler(handler)


def error_of(response) -> dict:
    """The agent's error shape: ``{"error": {"type", "reason", "request_id"}}`` with a real reason; on the OpenAI
    endpoints OpenAI's, ``{"error": {"message", "type", "param", "code"}}``, its message the reason."""
    err = response.json()["error"]
    assert isinstance(err["type"], str) and err["type"], response.text
    if "message" in err:
        assert {"param", "code"} <= set(err), response.text
        err = {**err, "reason": err["message"]}
    assert isinstance(err["reason"], str) and len(err["reason"].strip()) > 5, response.text
    return err


# --- Schemathesis over the OpenAPI schema -------------------------------------------------------------
class Fuzzed:
    """The agent under fuzzing and its scripted upstream, built at import without starting either (the
    schema is read at import): the upstream starts, the trace opens and the agent's lifespan runs only in
    the test (``fuzzed``). Also what the checks saw."""

    def __init__(self):
        self.upstream = FakeUpstream()
        self.upstream.reply = scripted_reply
        cfg = AgentConfig(probe_interval_s=0.1, upstream_timeout_s=5, request_timeout_s=10)
        self.app = create_app(cfg, Upstream(self.upstream.url, label="scripted"))
        self.trace_path: Path | None = None
        self.log = LogLines()
        self.statuses: Counter[tuple[str, str, int]] = Counter()

    def summary(self) -> str:
        by_op: dict[str, Counter[str]] = {}
        for (op, mode, status), n in self.statuses.items():
            by_op.setdefault(op, Counter())[f"{mode} {status}"] += n
        total = sum(self.statuses.values())
        errors = sum(n for (_, _, status), n in self.statuses.items() if status >= 500)
        lines = [f"schemathesis {schemathesis.__version__}: {total} cases run, {errors} server errors"]
        lines += [f"  {op}: {sum(c.values())} cases; " + ", ".join(f"{k}: {n}" for k, n in sorted(c.items()))
                  for op, c in sorted(by_op.items())]
        return "\n".join(lines)


FUZZED = Fuzzed()
schema = schemathesis.openapi.from_dict(FUZZED.app.openapi())
schema.app = FUZZED.app  # requests go to the app in process (ASGI), as from_asgi's would
schema.config.generation.update(modes=list(schemathesis.GenerationMode), max_examples=EXAMPLES)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, pytestconfig):
    agent = FUZZED
    agent.trace_path = tmp_path_factory.mktemp("fuzz") / "trace.jsonl"
    agent.app.state.agent.trace = TraceWriter(agent.trace_path)
    agent.upstream.start()
    logging.getLogger("cartspec.agent").addHandler(agent.log)
    yield agent
    logging.getLogger("cartspec.agent").removeHandler(agent.log)
    shutdown_lifespans()  # Schemathesis keeps an app's lifespan running until the process exits otherwise
    agent.upstream.stop()
    if agent.statuses:  # shown in every run, not only with -s
        with pytestconfig.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
            print("\n" + agent.summary())


def query_of(case) -> str | None:
    body = case.body if isinstance(case.body, dict) else {}
    query = body.get("query")
    return query if isinstance(query, str) and len(query.strip()) >= 12 else None  # shorter: common words


@pytest.fixture(scope="module")
def errors_without_request_text(fuzzed):
    """A Schemathesis check: an error has the agent's shape and a reason, and neither the reason, the trace
    nor the log quotes the request's query."""

    def check(ctx, response, case):
        mode = case.meta.generation.mode.value if case.meta else "explicit"
        fuzzed.statuses[(case.operation.label, mode, response.status_code)] += 1
        logged, fuzzed.log.lines[:] = "\n".join(fuzzed.log.lines), []
        query = query_of(case)
        if query is not None:
            assert query not in logged, f"the log quotes the query: {logged[:300]}"
        if response.status_code < 400:
            return None
        err = error_of(response)
        rid = response.headers.get("x-request-id")
        traced = [r for r in read_trace(fuzzed.trace_path) if r["id"] == rid] if rid else []
        if query is not None:
            assert query not in err["reason"], err
            assert all(query not in (r.get("reason") or "") for r in traced), traced
        return None

    return check


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_are_never_a_server_error(case, errors_without_request_text):
    case.call_and_validate(checks=[not_a_server_error, errors_without_request_text])


# --- explicit cases: what the schema does not generate ----------------------------------------------
def deep(levels: int) -> str:
    return '{"query": "%s", "history": %s}' % (SECRET, "[" * levels + "]" * levels)


def deep_object(levels: int) -> str:
    return '{"query": "%s", "meta": %s}' % (SECRET, '{"a":' * levels + "1" + "}" * levels)


def turns(n: int, content: str = "earlier turn") -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": content} for i in range(n)]


BAD = [  # name, body (str or bytes), status, error type
    ("20k-deep array", deep(20_000), 400, "malformed_json"),
    ("20k-deep object", deep_object(20_000), 400, "malformed_json"),
    ("deep but parseable", deep(500), 422, "malformed_history"),
    ("4301-digit integer query", '{"query": %s}' % ("9" * 4301), 400, "malformed_json"),
    ("20k-digit negative integer", '{"query": "%s", "history": [-%s]}' % (SECRET, "9" * 20_000), 400,
     "malformed_json"),
    ("65-digit integer", '{"query": %s}' % ("1" * 65), 400, "malformed_json"),
    ("integer query", '{"query": 12345}', 422, "invalid_request"),
    ("huge float", '{"query": 1e999999}', 422, "invalid_request"),
    ("NaN", '{"query": NaN}', 422, "invalid_request"),
    ("lone high surrogate", '{"query": "%s \\ud800"}' % SECRET, 422, "invalid_characters"),
    ("lone low surrogate", '{"query": "\\udfff%s"}' % SECRET, 422, "invalid_characters"),
    ("reversed surrogate pair", '{"query": "%s \\udc00\\ud800"}' % SECRET, 422, "invalid_characters"),
    ("surrogate as UTF-8 bytes", ('{"query": "%s \\ud800"}' % SECRET).encode().replace(b"\\ud800", b"\xed\xa0\x80"),
     422, "invalid_characters"),
    ("surrogate in history", '{"query": "%s", "history": [{"role": "user", "content": "a\\ud800"}]}' % SECRET, 422,
     "malformed_history"),
    ("surrogate in a field name", '{"query": "%s", "\\ud800": 1}' % SECRET, 422, "invalid_request"),
    ("NUL", '{"query": "%s\\u0000"}' % SECRET, 422, "invalid_characters"),
    ("escape sequence", '{"query": "\\u001b[2J%s"}' % SECRET, 422, "invalid_characters"),
    ("DEL", '{"query": "%s\\u007f"}' % SECRET, 422, "invalid_characters"),
    ("C1 control", '{"query": "%s\\u009b"}' % SECRET, 422, "invalid_characters"),
    ("control character in history", json.dumps({"query": SECRET, "history": turns(1, "ok\x07")}), 422,
     "malformed_history"),
    ("raw control character", '{"query": "%s\x01"}' % SECRET, 400, "malformed_json"),
    ("not UTF-8", b'{"query": "\xff\xfe' + SECRET.encode() + b'"}', 400, "malformed_json"),
    ("17 turns", json.dumps({"query": SECRET, "history": turns(17)}), 422, "malformed_history"),
    ("1000 turns", json.dumps({"query": SECRET, "history": turns(1000, "x")}), 422, "malformed_history"),
    ("a turn over 4000 characters", json.dumps({"query": SECRET, "history": turns(1, "y" * 4001)}), 422,
     "malformed_history"),
    ("2001-character query", json.dumps({"query": SECRET + "z" * 2001}), 422, "query_too_long"),
]


@pytest.mark.parametrize("name,body,status,type_", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_that_quotes_nothing(upstream, tmp_path, agent_log, name, body, status, type_):
    with make_client(upstream, tmp_path, max_body_bytes=1024 * 1024) as c:  # past the body limit: parsed
        raw = body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")
        r = c.post("/v1/support", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, (name, r.text[:300])
    err = error_of(r)
    assert err["type"] == type_ and err["request_id"] == r.headers["x-request-id"]
    assert SECRET not in r.text and "4111" not in err["reason"]  # not r.text: a random request id may hold "4111"
    assert SECRET not in (tmp_path / "trace.jsonl").read_text()
    assert not any(SECRET in line or "Traceback" in line for line in agent_log.lines), agent_log.lines
    assert upstream.bodies == []  # never sent to the model


@pytest.mark.parametrize("declared,status,type_", [(b"9" * 5000, 413, "body_too_large"),  # past int()'s digits
                                                   ("²".encode("latin-1"), 422, "empty_query")])  # isdigit, not int
def test_a_content_length_int_cannot_read_is_no_server_error(upstream, tmp_path, declared, status, type_):
    with make_client(upstream, tmp_path) as c:
        r = c.post("/v1/search", content=b'{"query": ""}',
                   headers={"content-type": "application/json", "content-length": declared})
    assert r.status_code == status and error_of(r)["type"] == type_ and len(r.json()["error"]["reason"]) < 200


def test_a_failure_inside_the_agent_is_logged_without_the_request(upstream, tmp_path, agent_log):
    with make_client(upstream, tmp_path) as c:
        async def broken(endpoint, call, rec):
            raise ValueError(f"cannot handle {call.query!r}")

        c.app.state.agent.answer = broken
        r = c.post("/v1/search", json={"query": SECRET})
    assert r.status_code == 500
    err = error_of(r)
    assert err["type"] == "internal" and "ValueError" in err["reason"] and err["request_id"] in err["reason"]
    assert SECRET not in r.text
    logged = "\n".join(agent_log.lines)
    assert "Traceback" in logged and "ValueError" in logged and "broken" in logged  # where it broke...
    assert SECRET not in logged  # ...never with what
    [rec] = read_trace(tmp_path / "trace.jsonl")
    assert rec["status"] == 500 and SECRET not in json.dumps(rec)


# --- limits past the model's -------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,limit", [("max_query_chars", 2001, 2000), ("max_history_turns", 17, 16)])
def test_config_refuses_limits_past_what_the_model_takes(field, value, limit):
    with pytest.raises(ValidationError, match=f"{field} {value} is over what the model takes.*at most {limit}"):
        AgentConfig(**{field: value})
    assert getattr(AgentConfig(**{field: limit}), field) == limit


def test_limits_raised_after_loading_still_stop_at_the_models(upstream, tmp_path):
    with make_client(upstream, tmp_path) as c:
        cfg = c.app.state.agent.config
        cfg.max_query_chars, cfg.max_history_turns = 10_000, 100  # no validation on assignment
        r = c.post("/v1/search", json={"query": SECRET + "q" * 3000})
        assert r.status_code == 422 and error_of(r)["type"] == "query_too_long"
        assert "the limit is 2000" in r.json()["error"]["reason"]
        r = c.post("/v1/search", json={"query": SECRET, "history": turns(40)})
        assert r.status_code == 422 and "the limit is 16" in error_of(r)["reason"]
    assert upstream.bodies == []


def test_a_conversation_past_the_models_context_is_422(upstream, tmp_path):
    upstream.status = 400  # vLLM's refusal, word for word (vllm/renderers/params.py)
    upstream.error = ("This model's maximum context length is 1024 tokens. However, your prompt contains 1533 "
                      "input tokens, which exceeds this limit even without any output tokens. Please reduce the "
                      "length of the input prompt.")
    with make_client(upstream, tmp_path) as c:
        r = c.post("/v1/search", json={"query": SECRET, "history": turns(16, "z" * 400)})
    assert r.status_code == 422 and error_of(r)["type"] == "conversation_too_long"
    assert SECRET not in (tmp_path / "trace.jsonl").read_text()


def test_openapi_body_schema_is_self_contained_with_the_configs_limits(upstream, tmp_path):
    with make_client(upstream, tmp_path, max_query_chars=500, max_history_turns=4) as c:
        doc = c.get("/openapi.json").json()
    for path in ("/v1/search", "/v1/support"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert "$ref" not in json.dumps(body) and "$defs" not in body
        assert body["properties"]["query"]["maxLength"] == 500
        assert body["properties"]["history"]["maxItems"] == 4
        assert body["properties"]["history"]["items"]["properties"]["content"]["maxLength"] == 4000


def test_a_parameter_that_does_not_validate_is_a_422_in_the_agents_shape(upstream, tmp_path):
    with make_client(upstream, tmp_path) as c:
        @c.app.get("/probe")
        async def probe(n: int):
            return {"n": n}

        r = c.get("/probe", params={"n": SECRET})
    assert r.status_code == 422
    err = error_of(r)
    assert err["type"] == "invalid_request" and err["reason"].startswith("query.n: ") and SECRET not in r.text
