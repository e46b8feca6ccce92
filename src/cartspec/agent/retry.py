"""The retry policy of one model call: which attempts it makes, and when it answers, retries or gives up.

A ``RetryPolicy`` is built per request from its ``ChatCall``; ``first()`` is the attempt to make, and after
each one ``after_reply`` (the reply as read) or ``after_error`` (the deployment failed) says what to do next:

* ``Accept``: the reply is the answer. A valid reply; or one cut at max_tokens when the budget is the
  client's (a retry would be cut again: the answer as it is, ``finish_reason`` ``length`` saying so); or,
  after the last attempt, the last repaired value when no attempt was valid as it stood.
* ``Retry``: the next attempt of the call's plan (the constrained retry: constrained to the schema where the
  plan says so) at temperature 0, with twice the tokens when the reply was cut and the budget is the agent's.
* ``GiveUp``: no attempt gave a usable reply (``InvalidModelOutput``), or the deployment failed (its error as
  it is: a request is never retried on the deployment that failed it).

``call_error`` says which of these failures the caller is told as which status. No side effects: metrics,
the trace and the router are the agent's (``observer.CallObserver``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Union

from ..serving.client import UpstreamError
from .chat import ChatCall, Reading
from .errors import ApiError
from .upstream import UpstreamUnavailable

# An attempt's outcome as the attempts metric counts it.
Outcome = Literal["valid", "cut", "repaired", "unparsable"]
CONTEXT_TOO_LONG = re.compile(r"context length|max_model_len|maximum model length|too long", re.IGNORECASE)


class InvalidModelOutput(RuntimeError):
    """No attempt gave a reply the call can use (a 502 ``invalid_model_output``)."""


@dataclass(frozen=True)
class Attempt:
    """One model call's settings: its number (from 1), whether constrained to the format, its token budget and
    temperature."""

    number: int
    constrained: bool
    max_tokens: int
    temperature: float


@dataclass(frozen=True)
class Accept:
    """``value`` is the answer; ``repaired``: it is a repair (no attempt was valid as it stood)."""

    value: Any
    outcome: Outcome
    repaired: bool = False


@dataclass(frozen=True)
class Retry:
    """Ask again, with ``attempt``'s settings."""

    attempt: Attempt
    outcome: Outcome


@dataclass(frozen=True)
class GiveUp:
    """The request fails with ``error``; ``outcome`` is None when there was no reply to count (the deployment
    failed)."""

    error: Exception
    outcome: Outcome | None = None


Decision = Union[Accept, Retry, GiveUp]


class RetryPolicy:
    """What one call does after each attempt (see the module's docstring). Holds the call's best repair and
    last reason across its attempts: one policy per request."""

    def __init__(self, call: ChatCall):
        if not call.plan:
            raise ValueError("a call's plan needs at least one attempt (True where constrained to the format)")
        self.call = call
        self.repaired: Any | None = None  # the last repaired value, the answer if no attempt is valid
        self.last_error = ""

    def first(self) -> Attempt:
        """The first attempt: as the call asks (its temperature and max_tokens), constrained if the plan says so."""
        call = self.call
        return Attempt(1, call.plan[0], call.max_tokens, call.temperature)

    def after_reply(self, attempt: Attempt, reading: Reading, finish_reason: str | None) -> Decision:
        """What follows ``attempt``, whose reply read as ``reading`` and finished for ``finish_reason``."""
        call = self.call
        cut = finish_reason == "length"
        if reading.valid or (cut and not call.grow_on_length):
            return Accept(reading.value, "valid" if reading.valid else "cut")
        outcome: Outcome = "repaired" if reading.value is not None else "unparsable"
        if reading.value is not None:
            self.repaired = reading.value
        self.last_error = reading.error + (f" (cut at max_tokens={attempt.max_tokens})" if cut else "")
        if attempt.number < len(call.plan):
            max_tokens = attempt.max_tokens * 2 if cut else attempt.max_tokens
            return Retry(Attempt(attempt.number + 1, call.plan[attempt.number], max_tokens, 0.0), outcome)
        if self.repaired is not None:  # every attempt needed repair: the repaired value is still typed and valid
            return Accept(self.repaired, outcome, repaired=True)
        return GiveUp(InvalidModelOutput(self._reason()), outcome)

    def after_error(self, attempt: Attempt, exc: Exception) -> GiveUp:
        """The deployment failed ``attempt`` (down, unreachable, timed out, refused): the request fails with its
        error; the canary's failover to the current head is routing's, not a retry."""
        return GiveUp(exc)

    def _reason(self) -> str:
        call = self.call
        what = f"a valid {call.task} object" if call.task in ("search", "support") else "what response_format asks"
        return (f"the model's reply is not {what} after {len(call.plan)} attempt(s)"
                f"{', the last constrained to the schema' if call.plan[-1] else ''}: {self.last_error}")


def call_error(exc: BaseException, upstream_timeout_s: float) -> ApiError | None:
    """What the caller is told of a model call's failure: 503 (with ``Retry-After``) while the deployment is
    down, unreachable or failing, 504 when it timed out, 422 for a conversation past its context, 502 for a
    refusal or a reply no attempt could use. None: not a model call's failure."""
    if isinstance(exc, UpstreamUnavailable):
        return ApiError(exc.status, "upstream_unavailable", exc.reason,
                        {"Retry-After": str(max(1, round(exc.retry_after_s)))})
    if isinstance(exc, UpstreamError):
        if exc.status == 504:
            return ApiError(504, "upstream_timeout", f"model server did not answer within {upstream_timeout_s:g}s")
        if exc.status == 0:
            return ApiError(503, "upstream_unavailable", str(exc), {"Retry-After": "1"})
        if exc.status == 400 and CONTEXT_TOO_LONG.search(str(exc)):
            return ApiError(422, "conversation_too_long",
                            "query and history do not fit the model's context: shorten the history")
        if exc.status >= 500:
            return ApiError(503, "upstream_error", str(exc), {"Retry-After": "1"})
        return ApiError(502, "upstream_rejected", str(exc))
    if isinstance(exc, InvalidModelOutput):
        return ApiError(502, "invalid_model_output", str(exc))
    return None
