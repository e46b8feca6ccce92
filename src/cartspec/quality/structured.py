"""Structured accuracy of a served model: JSON validity, schema validity, fields, exact match."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from ..task.data import Request, read_requests
from ..task.generator import DEFAULT_SIZES, generate
from ..task.prompts import messages
from ..task.schema import json_schema
from ..task.score import aggregate, score_item

SPLITS = ("train", "dev", "test")


def load_requests(data: str, limit: int | None = None) -> list[Request]:
    """A split name (generated, seeded) or a JSONL request file."""
    if data in SPLITS:
        reqs = generate(data, DEFAULT_SIZES[data])  # type: ignore[arg-type]
    else:
        reqs = read_requests(data)
    return reqs[:limit] if limit else reqs


async def _ask_all(url: str, served_name: str, reqs: list[Request], concurrency: int, max_tokens: int,
                   structured: bool, temperature: float = 0.0, api_key: str | None = None) -> list[Any]:
    from rich.progress import Progress

    from ..serving.client import ChatClient, gather_limited

    async with ChatClient(url, served_name, api_key=api_key) as client:
        with Progress(transient=False) as bar:
            task = bar.add_task("requests", total=len(reqs))
            coros = [client.chat(messages(r), max_tokens=max_tokens, temperature=temperature,
                                 json_schema=json_schema(r.task) if structured else None) for r in reqs]
            return await gather_limited(coros, concurrency, on_done=lambda i, _: bar.advance(task))


def score_replies(reqs: list[Request], replies: list[Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    items, rows = [], []
    for req, rep in zip(reqs, replies):
        text = rep.text if not isinstance(rep, Exception) else ""
        item = score_item(req, text)
        items.append(item)
        wrong = item.wrong()  # for error analysis without re-deriving gold: jq 'select(.wrong.price_min)'
        rows.append({"id": req.id, "task": req.task, "query": req.query, "reply": text,
                     "error": str(rep) if isinstance(rep, Exception) else item.error,
                     "json_valid": item.json_valid, "schema_valid": item.schema_valid,
                     "exact": item.exact, "wrong_fields": list(wrong), "wrong": wrong,
                     "unseen": req.meta.get("unseen")})
    summary = aggregate(items, reqs)
    summary["n_request_errors"] = sum(isinstance(r, Exception) for r in replies)
    return summary, rows


def evaluate_model(model: str = "commerce", data: str = "test", out: Path = Path("runs/eval-model.json"),
                   server: str | None = None, served_name: str = "cartspec", structured: bool = False,
                   concurrency: int = 16, max_tokens: int = 160, limit: int | None = None,
                   log_dir: Path = Path("runs/logs"), dtype: str = "auto",
                   api_key_env: str | None = None) -> dict[str, Any]:
    """Score ``model`` (started with vLLM) or ``server`` (a running endpoint, its key in the environment
    variable ``api_key_env``) on ``data``; writes the scores to ``out`` and each reply beside it."""
    from ..serving.endpoint import api_key_from_env, endpoint
    from ..serving.engine import engine_versions
    from ..serving.spec import DeploymentSpec

    api_key = api_key_from_env(api_key_env)  # before the slow part: a missing key fails at once
    reqs = load_requests(data, limit)
    t0 = time.time()
    meta: dict[str, Any] = {"model": model, "data": data, "structured": structured, "temperature": 0.0,
                            "max_tokens": max_tokens}
    if server:
        meta["server"] = server
        if api_key_env:
            meta["server_api_key_env"] = api_key_env  # the variable's name; the key is never written
        target: DeploymentSpec | str = server
    else:
        target = DeploymentSpec(name=served_name, model=model, dtype=dtype).resolved()
        meta["dtype"] = target.dtype
    with endpoint(target, log_dir=log_dir, api_key=api_key, served_name=served_name) as ep:
        if not server:
            meta["deployment"] = ep.describe().model_dump(mode="json")
        replies = asyncio.run(_ask_all(ep.url, ep.served_name, reqs, concurrency, max_tokens, structured,
                                       api_key=ep.api_key))
    summary, rows = score_replies(reqs, replies)
    summary["meta"] = {**meta, "seconds": round(time.time() - t0, 1), "versions": engine_versions()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    with out.with_suffix(".replies.jsonl").open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return summary
