"""The agent's retry policy, with no server: what follows each attempt, and which failure is which status."""

from __future__ import annotations

import asyncio

import pytest

from cartspec.agent.chat import ChatCall, Reading, commerce_call
from cartspec.agent.retry import Accept, Attempt, GiveUp, InvalidModelOutput, Retry, RetryPolicy, call_error
from cartspec.agent.upstream import UpstreamUnavailable
from cartspec.serving.client import UpstreamError
from cartspec.task.data import Request as TaskRequest
from cartspec.task.schema import json_schema

VALID = Reading({"intent": "search"}, True)
REPAIRED = Reading({"intent": "search", "fixed": True}, False, "reply does not validate against the schema")
UNPARSABLE = Reading(None, False, "Expecting value: line 1 column 1 (char 0)")


def call(plan: list[bool], task: str = "search", grow: bool = True, max_tokens: int = 64,
         temperature: float = 0.7) -> ChatCall:
    return ChatCall(task=task, max_tokens=max_tokens, temperature=temperature, plan=plan,  # type: ignore[arg-type]
                    grow_on_length=grow)


def run(policy: RetryPolicy, replies: list[tuple[Reading, str]]) -> tuple[list[Attempt], Accept | GiveUp]:
    """The attempts ``policy`` makes when the model gives ``replies`` in turn, and how it ends."""
    attempt, made = policy.first(), []
    for reading, finish in replies:
        made.append(attempt)
        step = policy.after_reply(attempt, reading, finish)
        if not isinstance(step, Retry):
            return made, step
        attempt = step.attempt
    raise AssertionError(f"the policy asked for more than {len(replies)} attempts")


def test_the_first_attempt_is_the_call_as_asked():
    assert RetryPolicy(call([False, True])).first() == Attempt(1, False, 64, 0.7)
    assert RetryPolicy(call([True])).first() == Attempt(1, True, 64, 0.7)


def test_a_valid_reply_is_the_answer_at_once():
    step = RetryPolicy(call([False, True])).after_reply(Attempt(1, False, 64, 0.7), VALID, "stop")
    assert step == Accept(VALID.value, "valid", repaired=False)


def test_an_unparsable_reply_is_retried_constrained_at_temperature_zero():
    step = RetryPolicy(call([False, True])).after_reply(Attempt(1, False, 64, 0.7), UNPARSABLE, "stop")
    assert step == Retry(Attempt(2, True, 64, 0.0), "unparsable")


def test_the_commerce_endpoints_retry_an_unparsable_reply_constrained_to_the_schema():
    req = TaskRequest(query="red boots", history=[], task="search")
    c = commerce_call("search", req, json_schema("search"), max_tokens=160, temperature=0.0, structured=False,
                      retry=True)
    policy = RetryPolicy(c)
    first = policy.first()
    step = policy.after_reply(first, c.read("sure! here are boots"), "stop")
    assert isinstance(step, Retry) and step.attempt.constrained and step.attempt.number == 2
    assert "response_format" not in c.body(first.constrained, first.max_tokens, first.temperature)
    assert c.body(step.attempt.constrained, step.attempt.max_tokens, step.attempt.temperature)["response_format"]


def test_a_repair_is_retried_and_a_valid_retry_answers_unrepaired():
    made, end = run(RetryPolicy(call([False, True])), [(REPAIRED, "stop"), (VALID, "stop")])
    assert [a.number for a in made] == [1, 2]
    assert end == Accept(VALID.value, "valid", repaired=False)


def test_when_no_attempt_is_valid_the_last_repair_answers_marked_repaired():
    _, end = run(RetryPolicy(call([False, True])), [(REPAIRED, "stop"), (UNPARSABLE, "stop")])
    assert end == Accept(REPAIRED.value, "unparsable", repaired=True)
    _, end = run(RetryPolicy(call([False, True])), [(UNPARSABLE, "stop"), (REPAIRED, "stop")])
    assert end == Accept(REPAIRED.value, "repaired", repaired=True)


def test_no_usable_reply_gives_up_with_the_last_reason():
    made, end = run(RetryPolicy(call([False, True])), [(UNPARSABLE, "stop")] * 2)
    assert len(made) == 2 and isinstance(end, GiveUp) and end.outcome == "unparsable"
    assert isinstance(end.error, InvalidModelOutput)
    assert str(end.error) == ("the model's reply is not a valid search object after 2 attempt(s), the last "
                              "constrained to the schema: " + UNPARSABLE.error)


def test_a_chat_call_gives_up_naming_its_response_format_and_an_unconstrained_last_attempt():
    _, end = run(RetryPolicy(call([False], task="chat")), [(UNPARSABLE, "stop")])
    assert isinstance(end, GiveUp)
    assert str(end.error) == ("the model's reply is not what response_format asks after 1 attempt(s): "
                              + UNPARSABLE.error)


@pytest.mark.parametrize("plan", [[False], [True], [False, True], [True, True], [False, True, True]])
def test_never_more_attempts_than_the_plan(plan):
    made, end = run(RetryPolicy(call(plan)), [(UNPARSABLE, "stop")] * 5)
    assert [a.number for a in made] == list(range(1, len(plan) + 1))
    assert [a.constrained for a in made] == plan
    assert [a.temperature for a in made] == [0.7] + [0.0] * (len(plan) - 1)
    assert isinstance(end, GiveUp) and f"after {len(plan)} attempt(s)" in str(end.error)


def test_a_reply_cut_on_the_agents_budget_is_retried_with_twice_the_tokens():
    made, end = run(RetryPolicy(call([False, True, True])), [(UNPARSABLE, "length")] * 3)
    assert [a.max_tokens for a in made] == [64, 128, 256]
    assert isinstance(end, GiveUp) and str(end.error).endswith("(cut at max_tokens=256)")


def test_a_reply_that_was_not_cut_keeps_its_budget_on_retry():
    made, _ = run(RetryPolicy(call([False, True])), [(UNPARSABLE, "stop"), (VALID, "stop")])
    assert [a.max_tokens for a in made] == [64, 64]


def test_a_reply_cut_on_the_clients_budget_is_the_answer_as_it_is():
    policy = RetryPolicy(call([True, True], task="chat", grow=False))
    step = policy.after_reply(policy.first(), UNPARSABLE, "length")
    assert step == Accept(None, "cut", repaired=False)  # a retry would be cut again


def test_an_upstream_failure_is_never_retried_and_keeps_its_error():
    policy = RetryPolicy(call([False, True]))
    for exc in (UpstreamError("boom", status=500), UpstreamError("down", status=0), UpstreamUnavailable("full")):
        step = policy.after_error(policy.first(), exc)
        assert step == GiveUp(exc, None) and step.error is exc


def test_a_call_without_attempts_is_refused():
    with pytest.raises(ValueError, match="at least one attempt"):
        RetryPolicy(call([]))


# --- which failure is which status ------------------------------------------------------------------------------
@pytest.mark.parametrize("exc, status, type_, retry_after", [
    (UpstreamUnavailable("speculative: queue full", status=503, retry_after_s=2.4), 503, "upstream_unavailable", "2"),
    (UpstreamUnavailable("speculative: down", status=503, retry_after_s=0.1), 503, "upstream_unavailable", "1"),
    (UpstreamError("read timeout", status=504), 504, "upstream_timeout", None),
    (UpstreamError("connection refused", status=0), 503, "upstream_unavailable", "1"),
    (UpstreamError("This model's maximum context length is 2048 tokens", status=400), 422,
     "conversation_too_long", None),
    (UpstreamError("bad grammar", status=400), 502, "upstream_rejected", None),
    (UpstreamError("not found", status=404), 502, "upstream_rejected", None),
    (UpstreamError("engine died", status=500), 503, "upstream_error", "1"),
    (InvalidModelOutput("no usable reply"), 502, "invalid_model_output", None),
])
def test_a_model_calls_failure_becomes_its_status(exc, status, type_, retry_after):
    err = call_error(exc, upstream_timeout_s=30)
    assert (err.status, err.type, err.headers.get("Retry-After")) == (status, type_, retry_after)
    if type_ == "upstream_timeout":
        assert err.reason == "model server did not answer within 30s"


@pytest.mark.parametrize("exc", [asyncio.TimeoutError(), ValueError("x"), RuntimeError("y")])
def test_what_is_not_a_model_calls_failure_is_left_to_the_app(exc):
    assert call_error(exc, upstream_timeout_s=30) is None
