"""A request's failure as the caller is told it: ``ApiError``, one status, type and reason.

The app renders it as ``{"error": {"type", "reason", "request_id"}}`` (``openai_api`` in OpenAI's shape); the
retry policy (``retry.call_error``) says which model-call failure becomes which one.
"""

from __future__ import annotations


class ApiError(Exception):
    """A request's failure as the caller is told it; ``param``: the request field at fault (OpenAI's errors)."""

    def __init__(self, status: int, type_: str, reason: str, headers: dict[str, str] | None = None,
                 param: str | None = None):
        super().__init__(reason)
        self.status, self.type, self.reason, self.headers, self.param = status, type_, reason, headers or {}, param
