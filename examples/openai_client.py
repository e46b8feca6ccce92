"""The `openai` SDK against `cartspec serve`: the models, a chat reply, a streamed one, one held to a JSON schema.

    CARTSPEC_API_KEY=... cartspec serve --api-key-env CARTSPEC_API_KEY &
    CARTSPEC_API_KEY=... python examples/openai_client.py --base-url http://127.0.0.1:8080/v1

Any client of OpenAI's API works the same way; the agent routes, falls back, records and traces each request
as it does its own commerce endpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from openai import OpenAI

SEARCH_SCHEMA = {
    "type": "object",
    "properties": {"category": {"type": "string"}, "color": {"type": "string"},
                   "max_price": {"type": "number"}, "exclude_brands": {"type": "array", "items": {"type": "string"}}},
    "required": ["category", "color", "max_price", "exclude_brands"],
    "additionalProperties": False,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key-env", default="CARTSPEC_API_KEY", help="the variable that holds the agent's key")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=os.environ.get(args.api_key_env) or "none")

    model = client.models.list().data[0].id
    print(f"model: {model}")

    ask = [{"role": "user", "content": "Where is my order AB12345?"}]
    t0 = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=ask, max_tokens=args.max_tokens, temperature=0)
    print(f"chat ({(time.perf_counter() - t0) * 1000:.0f} ms, {reply.usage.completion_tokens} tokens): "
          f"{reply.choices[0].message.content!r}")

    t0, first, pieces = time.perf_counter(), None, []
    stream = client.chat.completions.create(model=model, messages=ask, max_tokens=args.max_tokens, temperature=0,
                                            stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            pieces.append(chunk.choices[0].delta.content)
    print(f"streamed: {len(pieces)} chunks, first after {first * 1000:.0f} ms, "
          f"all after {(time.perf_counter() - t0) * 1000:.0f} ms: {''.join(pieces)!r}")

    query = [{"role": "user", "content": "red trail runners under $120, no nike"}]
    t0 = time.perf_counter()
    reply = client.chat.completions.create(
        model=model, messages=query, max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "search", "schema": SEARCH_SCHEMA}})
    text = reply.choices[0].message.content
    print(f"json_schema ({(time.perf_counter() - t0) * 1000:.0f} ms): {json.loads(text)}")


if __name__ == "__main__":
    main()
