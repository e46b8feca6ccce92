"""The canary on real vLLM: `cartspec serve` runs a registered head's current version and a candidate version
as two engines (tiny random Llama, random EAGLE-3 heads), sends every second speculative request to the
candidate, and records each answered request with the route and head version that drafted it. The engines'
logs survive the agent's shutdown (its keeper once restarted the engines the shutdown stopped).

The tiny model's words are random: a reply answers 200 with a valid object or 502 ``invalid_model_output``
when cut at max_tokens (as in test_agent_vllm.py). What is checked is the path through real engines:
each arm runs its own engine with its own version (vLLM's per-request metrics come back from each), the
share is exact, and the trace, headers, /v1/info and the traffic log name the version that drafted each
reply. (The per-request draft counts are 0: vLLM drops
drafted tokens the JSON grammar forbids, and a random head drafts none it allows; the real model's drafting
through the canary is measured by benchmarks/head_refresh_drill.py.)
"""

from __future__ import annotations

import httpx
import pytest
from conftest import make_random_head

pytestmark = pytest.mark.vllm


@pytest.mark.timeout(900)
def test_serve_canaries_a_registered_candidate_on_real_vllm_and_records_who_drafted(tiny_llama_dir, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    from cartspec.agent.config import AgentConfig
    from cartspec.agent.process import AgentProcess
    from cartspec.agent.trace import read_trace
    from cartspec.model.heads import HeadRegistry
    from cartspec.model.registry import target_digest
    from cartspec.task.traffic import read_traffic

    reg = HeadRegistry("tiny")
    pin = {"digest": target_digest(tiny_llama_dir), "name": "tiny"}  # as `draft train` pins its heads
    for seed in (0, 1):
        reg.add(make_random_head(tiny_llama_dir, tmp_path / f"head{seed}", seed=seed, target=pin))
    assert [(v.version, v.status) for v in reg.versions()] == [("v0001", "current"), ("v0002", "candidate")]

    cfg = AgentConfig(trace_path=tmp_path / "trace.jsonl", max_tokens={"search": 48, "support": 48},
                      probe_interval_s=0.2, upstream_timeout_s=120, request_timeout_s=240)
    # no decision in six requests: the trial is what this test watches
    cfg = cfg.model_copy(update={"canary": cfg.canary.model_copy(update={"min_requests": 1000,
                                                                        "min_rollback_requests": 1000,
                                                                        "window_requests": 1000})})
    args = ["--model", str(tiny_llama_dir), "--head", "tiny", "--draft", "eagle3", "--gamma", "3",
            "--canary-head", "tiny@v0002", "--canary-share", "0.5", "--record-traffic", str(tmp_path / "traffic"),
            "--enforce-eager", "--log-dir", str(tmp_path / "logs")]
    queries = ["red trail runners under $120", "black hoodie size m", "wool socks, no nike", "blue sandals",
               "white sneakers size 9", "leather belt under $40"]
    with AgentProcess(cfg, args, out_dir=tmp_path, name="agent", start_timeout_s=600) as agent:
        info = httpx.get(agent.url + "/v1/info", timeout=10).json()
        assert info["canary"]["state"] == "trial" and info["canary"]["candidate"] == "tiny@v0002"
        rs = [httpx.post(agent.url + "/v1/search", json={"query": q}, timeout=240) for q in queries]
        after = httpx.get(agent.url + "/v1/info", timeout=10).json()["canary"]
    assert all(r.status_code in (200, 502) for r in rs), [r.text for r in rs]
    assert any(r.status_code == 200 for r in rs)
    for r in rs:
        if r.status_code == 502:
            assert r.json()["error"]["type"] == "invalid_model_output", r.text
    routes = [r.headers["x-cartspec-route"].split(";")[0] for r in rs]
    assert routes == ["speculative", "candidate"] * 3
    arms = [r.headers["x-cartspec-canary"].split(";")[0] for r in rs]
    assert arms == ["current", "candidate"] * 3
    assert all("state=trial" in r.headers["x-cartspec-canary"] for r in rs)

    trace = {t["id"]: t for t in read_trace(tmp_path / "trace.jsonl")}
    for r, route in zip(rs, routes):
        t = trace[r.headers["x-request-id"]]
        assert (t["head"], t["head_version"]) == ("tiny", "v0001" if route == "speculative" else "v0002")
        assert t["canary"]["arm"] == ("current" if route == "speculative" else "candidate")
        # vLLM's per-request speculative metrics came back from each engine. Their counts are 0 here: vLLM
        # drops drafted tokens the reply's JSON grammar forbids, and a random head drafts nothing it allows.
        assert t["spec"] is not None and t["spec"]["acceptance_length"] is not None, t
    assert after["state"] == "trial"
    # each engine loaded its own version of the head, and its log survived the shutdown whole
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("vllm-*.log")}
    assert len(logs) == 2, list(logs)
    for version in ("v0001", "v0002"):
        log = next(text for text in logs.values() if f"heads/tiny/versions/{version}" in text.splitlines()[0])
        assert "Loading safetensors checkpoint shards" in log, log[:2000]

    answered = [r for r in rs if r.status_code == 200]
    recs = read_traffic(tmp_path / "traffic")
    assert len(recs) == len(answered)
    by_id = {rec.id: rec for rec in recs}
    for r in answered:
        rec = by_id[r.headers["x-request-id"]]
        route = r.headers["x-cartspec-route"].split(";")[0]
        assert rec.route == route and rec.head == "tiny"
        assert rec.head_version == ("v0001" if route == "speculative" else "v0002")
        assert rec.gamma == 3 and rec.deployment == r.headers["x-cartspec-deployment"]
        assert rec.reply.strip() and rec.output_tokens > 0 and rec.messages[-1]["content"]
