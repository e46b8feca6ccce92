"""Chat prompts for the two tasks, rendered with the model's own chat template."""

from __future__ import annotations

from typing import Any

from .data import Request

# Short on purpose: every prompt token is paid for in training and in prefill.
# The fine-tune learns the schema; the base model only gets the gist.
SEARCH_SYSTEM = "Extract the shopper's product search parameters as one JSON object."
SUPPORT_SYSTEM = "Answer the shopper's support question as one JSON object with topic and reply."
SYSTEM = {"search": SEARCH_SYSTEM, "support": SUPPORT_SYSTEM}


def messages(req: Request) -> list[dict[str, str]]:
    """OpenAI-style messages: system (the request's own, else the task's; none when empty), the
    conversation so far, the new query."""
    system = SYSTEM[req.task] if req.system is None else req.system
    msgs = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": t.role, "content": t.content} for t in req.history]
    msgs.append({"role": "user", "content": req.query})
    return msgs


def render(tokenizer: Any, req: Request) -> str:
    """The prompt text the server builds for ``messages(req)``; used in training."""
    return tokenizer.apply_chat_template(messages(req), tokenize=False, add_generation_prompt=True)
