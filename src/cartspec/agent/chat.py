"""The agent's one path to the model: a ``ChatCall`` is what every endpoint asks of it.

``/v1/chat/completions`` and ``/v1/completions`` send the client's messages or prompt; ``/v1/search`` and
``/v1/support`` are one application on the same path: they build the commerce task's messages and its reply
schema (``commerce_call``). Routing, admission, the canary, the acceptance fallback, the constrained retry,
traces, metrics and traffic recording see only the call. A call's ``read`` says whether a reply is usable:
the commerce task's typed reader, a JSON schema's validator, a JSON object's parser, or anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from ..task.data import Request as TaskRequest
from ..task.data import Turn
from ..task.parse import read_reply
from ..task.prompts import messages as task_messages

Task = Literal["search", "support", "chat", "completion"]
CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"


@dataclass
class Reading:
    """What a reply gives: ``value`` (None: nothing usable), whether it is valid as it stands, and if not why
    (a position and a rule, never the reply's text). A value that is not valid is a repair: the commerce
    reader fixes what it can and keeps the result typed."""

    value: Any | None
    valid: bool
    error: str = ""


Reader = Callable[[str], Reading]


def read_any(text: str) -> Reading:
    return Reading(text, True)


def read_json_object(text: str) -> Reading:
    """``response_format`` ``json_object``: the reply is one JSON object."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        return Reading(None, False, f"the reply is not valid JSON: {getattr(exc, 'msg', type(exc).__name__)}")
    if not isinstance(value, dict):
        return Reading(None, False, f"the reply is a JSON {type(value).__name__}, not an object")
    return Reading(text, True)


def schema_reader(schema: dict[str, Any]) -> Reader:
    """``response_format`` ``json_schema``: the reply parses and validates against ``schema`` (JSON Schema
    2020-12, what vLLM's structured outputs take)."""
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(schema)

    def read(text: str) -> Reading:
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            return Reading(None, False, f"the reply is not valid JSON: {getattr(exc, 'msg', type(exc).__name__)}")
        try:
            error = next(iter(validator.iter_errors(value)), None)
        except Exception as exc:  # a reference it cannot resolve, a pattern Python's re cannot read
            return Reading(None, False, f"the schema cannot be checked here ({type(exc).__name__})")
        if error is not None:  # where and which rule, never the value
            where = "/" + "/".join(str(p) for p in error.absolute_path)
            return Reading(None, False, f"the reply does not match the schema at {where}: fails '{error.validator}'")
        return Reading(text, True)

    return read


def commerce_reader(task: str) -> Reader:
    """The commerce task's reader (``task.parse.read_reply``): a typed object, repaired where it can be."""

    def read(text: str) -> Reading:
        reading = read_reply(task, text)
        if reading.value is None:
            return Reading(None, False, reading.parsed.error or "reply does not parse")
        valid = reading.schema_valid
        return Reading(reading.value, valid, "" if valid else "reply does not validate against the schema")

    return read


@dataclass
class ChatCall:
    """One request on the agent's path, as the model is to be asked it.

    ``messages`` (chat) or ``prompt`` (a completion) are sent as they are; ``sampling`` holds the client's
    other sampling fields, passed to vLLM unchanged (top_p, seed, stop, ...). ``response_format`` is sent on a
    constrained attempt: the client's own, or the commerce task's schema. ``plan`` lists the attempts, True
    where constrained: the first as asked, then the constrained retry at temperature 0 when a reply is not
    valid. ``grow_on_length``: a reply cut at max_tokens is retried with twice the tokens (the commerce task,
    whose budget is the agent's); otherwise a cut reply is the answer, ``finish_reason`` ``length`` saying so,
    as OpenAI's API does. ``query``/``history`` are what the traffic log and the cache key keep of a commerce
    request; ``route_text`` is what the router's length estimate reads."""

    task: Task
    max_tokens: int
    temperature: float
    plan: list[bool]
    read: Reader = read_any
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    response_format: dict[str, Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    grow_on_length: bool = False
    query: str = ""
    history: list[Turn] = field(default_factory=list)
    route_text: str = ""

    @property
    def path(self) -> str:
        return COMPLETION_PATH if self.prompt is not None else CHAT_PATH

    def body(self, constrained: bool, max_tokens: int, temperature: float, stream: bool = False) -> dict[str, Any]:
        """The upstream request of one attempt (``model`` is the deployment's, set by ``Upstream``)."""
        body: dict[str, Any] = {**self.sampling, "max_tokens": max_tokens, "temperature": temperature}
        if self.prompt is not None:
            body["prompt"] = self.prompt
        else:
            body["messages"] = self.messages
        if constrained and self.response_format is not None:
            body["response_format"] = self.response_format
        if stream:  # always with usage: the last chunk carries vLLM's per-request speculative counts
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


def commerce_call(task: str, req: TaskRequest, schema: dict[str, Any], *, max_tokens: int, temperature: float,
                  structured: bool, retry: bool) -> ChatCall:
    """``/v1/search`` and ``/v1/support``: the task's messages, constrained to its schema (when ``structured``),
    read as its typed reply, with the constrained retry (``retry``)."""
    return ChatCall(task=task, max_tokens=max_tokens, temperature=temperature,  # type: ignore[arg-type]
                    plan=[structured] + ([True] if retry else []), read=commerce_reader(task),
                    messages=task_messages(req), grow_on_length=True, query=req.query, history=list(req.history),
                    response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}},
                    route_text=req.query)
