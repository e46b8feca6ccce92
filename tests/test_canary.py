"""The canary of a candidate head, and traffic recording, in the agent: the state machine alone, then
through the app against scripted upstreams, the wiring, and ``cartspec serve`` (no vLLM).

A candidate head gets every k-th request bound for the speculative deployment (a counter, reproducible);
it is promoted (all speculative traffic, and the head registry's current) when it drafts better by the
margin with enough replies, and rolled back at once (no more traffic, rejected in the registry) when its
acceptance falls or its errors rise. Every reply is the target's whatever head drafted it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from cartspec.agent import AgentConfig, Upstream, Upstreams
from cartspec.agent.acceptance import reply_stats
from cartspec.agent.canary import Canary, Moments, welch_interval
from cartspec.agent.config import CanaryConfig, FallbackConfig
from cartspec.agent.trace import read_trace
from cartspec.agent.wiring import apply_flags, build_upstreams, candidate_head, canary_spec
from cartspec.serving.spec import DeploymentSpec, Speculative
from cartspec.task.traffic import TrafficConfig, read_traffic
from test_agent_app import SEARCH_JSON, FakeUpstream, _free_port, make_client, post
from test_agent_cli import wait_ready
from test_agent_wiring import DOMAIN, Starts


def spec(accepted: int, drafted: int = 30, steps: int = 10) -> dict:
    """vLLM's per-request speculative metrics, as the agent reads them (τ = 1 + accepted / steps)."""
    return {"num_spec_steps": steps, "num_draft_tokens": drafted, "num_accepted_draft_tokens": accepted,
            "draft_acceptance_rate": accepted / drafted if drafted else None}


def reply(accepted: int, drafted: int = 30, steps: int = 10):
    return reply_stats(spec(accepted, drafted, steps))


def canary(**kw) -> Canary:
    settings = dict(share=0.25, min_requests=8, margin=0.05, rollback_acceptance=0.8, min_rollback_requests=4,
                    max_error_increase=0.05, window_requests=8)
    return Canary(CanaryConfig(**{**settings, **kw}), candidate="shop@v0002", current="shop@v0001")


# --- the state machine -------------------------------------------------------------------
def test_the_candidate_gets_exactly_every_kth_speculative_request():
    c = canary(share=0.25)
    assert [c.route() for _ in range(12)] == [False, False, False, True] * 3  # a counter, not a coin
    c10 = Canary(CanaryConfig())  # default share 0.1
    assert sum(c10.route() for _ in range(1000)) == 100 and c10.every == 10 and c10.share == pytest.approx(0.1)


def test_a_better_candidate_is_promoted_after_min_requests_then_gets_all_traffic():
    c = canary()
    decisions = []
    for i in range(8):
        decisions.append(c.observe("current", reply(11 + i % 3)))    # τ 2.1 .. 2.3
        if i < 7:
            decisions.append(c.observe("candidate", reply(19 + i % 3)))  # τ 2.9 .. 3.1
    assert decisions == [None] * 15 and c.state == "trial"  # 7 candidate replies < min_requests
    d = c.observe("candidate", reply(20))
    assert (d.decision, d.reason, d.state, c.state) == ("promote", "better", "promoted", "promoted")
    f = d.figures
    assert f["candidate"]["replies"] == 8 and f["current"]["replies"] == 8
    assert f["candidate"]["tau"] == pytest.approx(3.0, abs=0.05) and f["current"]["tau"] == pytest.approx(2.2, abs=0.05)
    assert f["tau_diff_ci"][0] > 0 and f["tau_diff"] == pytest.approx(0.8, abs=0.05)
    assert f["candidate"]["acceptance"] == pytest.approx(2 / 3, abs=0.02)
    assert "candidate τ 2.987 vs current 2.188 (difference +0.800, 95% interval [+0.718," in d.describe()
    assert all(c.route() for _ in range(10)) and c.share == 1.0
    assert c.observe("candidate", reply(0)) is None and c.state == "promoted"  # final: no more observations


def test_no_promotion_under_the_margin_or_when_the_interval_reaches_zero():
    close = canary(margin=0.05)
    for i in range(40):  # τ 2.2 vs 2.25: better, surely, but by 2%: under the 5% margin
        close.observe("current", reply(12))
        close.observe("candidate", reply(12 + (i % 2)))
    assert close.state == "trial"
    noisy = canary(margin=0.0)
    for i in range(10):  # candidate mean a little higher, spread wide: the interval reaches below 0
        noisy.observe("current", reply(12 + (i % 2) * 10 - 5))
        noisy.observe("candidate", reply(13 + (i % 2) * 10 - 5))
    assert noisy.state == "trial"
    assert noisy.figures()["tau_diff_ci"][0] < 0 < noisy.figures()["tau_diff"]


def test_worse_acceptance_rolls_back_at_once_after_min_rollback_requests():
    c = canary()
    for _ in range(10):
        c.observe("current", reply(15))                  # 0.5
    assert [c.observe("candidate", reply(6)) for _ in range(3)] == [None] * 3  # 0.2, but 3 < 4 requests
    d = c.observe("candidate", reply(6))
    assert (d.decision, d.reason, c.state, c.share) == ("rollback", "acceptance", "rolled_back", 0.0)
    assert d.figures["candidate"]["rolling_acceptance"] == pytest.approx(0.2)
    assert "0.200 < 0.8 × current 0.500" in d.describe()
    assert not any(c.route() for _ in range(20))


def test_acceptance_within_the_rollback_bound_stays_in_trial():
    c = canary()
    for _ in range(30):
        c.observe("current", reply(15))
        c.observe("candidate", reply(13))  # 0.433 > 0.8 × 0.5
    assert c.state == "trial"


def test_errors_roll_back_when_the_candidate_fails_more_than_the_current():
    c = canary()
    for _ in range(12):
        c.observe("current", reply(15))
    c.observe("current", None, error=True)  # the current fails now and then too: 1 in 8 of its window
    for _ in range(3):
        c.observe("candidate", reply(15))
    d = c.observe("candidate", None, error=True)  # 1 in 4 = 0.25 > 0.125 + 0.05
    assert (d.decision, d.reason) == ("rollback", "errors")
    assert d.figures["candidate"]["errors"] == 1 and d.figures["candidate"]["error_rate"] == 0.25
    assert "error rate 0.250 > current 0.125" in d.describe()


def test_replies_without_drafts_are_no_observations_of_the_head():
    c = canary()
    for _ in range(20):
        c.observe("candidate", None)
        c.observe("current", reply_stats(spec(0, 0, 0)))
    assert c.arms["candidate"].replies == 0 and c.arms["candidate"].requests == 20 and c.state == "trial"


def test_welch_interval_from_running_sums():
    a, b = Moments(), Moments()
    for x in (3.0, 3.2, 2.8, 3.0):
        a.add(x)
    for x in (2.0, 2.4, 2.2):
        b.add(x)
    diff, lo, hi = welch_interval(a, b)
    assert diff == pytest.approx(0.8)
    assert a.var == pytest.approx(0.04 * 2 / 3) and b.var == pytest.approx(0.04)
    half = 1.96 * (a.var / 4 + b.var / 3) ** 0.5
    assert (lo, hi) == (pytest.approx(diff - half, abs=1e-3), pytest.approx(diff + half, abs=1e-3))
    assert welch_interval(Moments(), b) is None


def test_canary_config_checks_its_bounds():
    assert CanaryConfig().share == 0.1 and CanaryConfig().min_requests == 50 and CanaryConfig().margin == 0.05
    with pytest.raises(ValueError):
        CanaryConfig(share=0.6)  # the current head must keep the larger share to compare against
    with pytest.raises(ValueError, match="min_rollback_requests"):
        CanaryConfig(min_rollback_requests=60, window_requests=50)
    cfg = AgentConfig.model_validate({"canary": {"head": "shop@v0002", "share": 0.2}})
    assert cfg.canary.head == "shop@v0002" and cfg.public()["canary"]["share"] == 0.2


# --- through the app -------------------------------------------------------------------------
class Scripted(FakeUpstream):
    """A fake deployment whose per-request speculative metrics come from ``script(n)`` (n: its n-th call)."""

    def __init__(self, script):
        super().__init__()
        self.script = script

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.bodies.append(body)
            if self.status != 200:
                return JSONResponse({"error": {"message": "scripted failure"}}, status_code=self.status)
            sd = self.script(len(self.bodies))
            return {"choices": [{"message": {"content": SEARCH_JSON}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 40, "completion_tokens": 25},
                    "metrics": {"speculative_decoding": sd} if sd else {}}

        return app


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """$CARTSPEC_HOME/heads/shop with v0001 (current) and v0002 (candidate), both pinned to one target."""
    from cartspec.model.heads import HeadRegistry

    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    reg = HeadRegistry("shop")
    for i in (1, 2):
        head = tmp_path / f"head{i}"
        head.mkdir()
        (head / "config.json").write_text(json.dumps({"cartspec": {"target": {"digest": "d1", "name": "commerce"}}}))
        reg.add(head, provenance={"n": i})
    assert [(v.version, v.status) for v in reg.versions()] == [("v0001", "current"), ("v0002", "candidate")]
    return reg


def two_heads(current_script, candidate_script):
    cur, cand = Scripted(current_script).start(), Scripted(candidate_script).start()
    ups = Upstreams(speculative=Upstream(cur.url, label="eagle3-shop-g3", info={"head": "shop@v0001"}),
                    candidate=Upstream(cand.url, label="eagle3-shop@v0002-g3", info={"head": "shop@v0002"}))
    return cur, cand, ups


TRIAL = CanaryConfig(share=0.25, min_requests=8, min_rollback_requests=4, window_requests=8)


def test_app_promotes_a_better_candidate_with_header_metrics_trace_log_and_registry(tmp_path, registry, caplog):
    cur, cand, ups = two_heads(lambda n: spec(11 + n % 3), lambda n: spec(19 + n % 3))
    caplog.set_level(logging.INFO, logger="cartspec.agent")
    try:
        with make_client(ups, tmp_path, canary=TRIAL) as c:
            rs = [post(c, "/v1/search", {"query": f"boots {i}"}) for i in range(32)]
            assert all(r.status_code == 200 and r.json()["keywords"] == "running shoes" for r in rs)
            assert [r.headers["x-cartspec-route"].split(";")[0] for r in rs[:8]] == \
                ["speculative"] * 3 + ["candidate"] + ["speculative"] * 3 + ["candidate"]
            assert rs[3].headers["x-cartspec-route"] == "candidate; reason=canary"
            assert rs[0].headers["x-cartspec-canary"] == "current; state=trial; n=0"
            assert rs[3].headers["x-cartspec-canary"] == "candidate; state=trial; n=1"
            assert rs[31].headers["x-cartspec-canary"] == "candidate; state=promoted; n=8; decision=promote"
            assert rs[3].headers["x-cartspec-deployment"] == "eagle3-shop@v0002-g3"
            assert (len(cur.bodies), len(cand.bodies)) == (24, 8)
            after = [post(c, "/v1/search", {"query": f"shoes {i}"}) for i in range(4)]
            assert {r.headers["x-cartspec-route"] for r in after} == {"candidate; reason=canary-promoted"}
            assert len(cand.bodies) == 12 and len(cur.bodies) == 24
            m = c.get("/metrics").text
            assert 'cartspec_canary_decisions_total{decision="promote"} 1.0' in m
            assert 'cartspec_canary_decisions_total{decision="rollback"} 0.0' in m
            assert 'cartspec_canary_state{state="promoted"} 1.0' in m and "cartspec_canary_share 1.0" in m
            assert 'cartspec_canary_replies{arm="candidate"} 8.0' in m
            info = c.get("/v1/info").json()["canary"]
            assert info["state"] == "promoted" and info["candidate"] == "shop@v0002"
            assert info["decision"] == {"decision": "promote", "reason": "better"}
        assert registry.current().version == "v0002"
        assert registry.get("v0001").status == "retired"
        promote = [e for e in registry.events() if e.get("event") == "promote"]
        assert len(promote) == 1 and "canary" in promote[0]["reason"]
        logged = [r.getMessage() for r in caplog.records if "canary: promote" in r.getMessage()]
        assert len(logged) == 1 and '"tau_diff_ci"' in logged[0] and "shop@v0002" in logged[0]
        trace = read_trace(tmp_path / "trace.jsonl")
        assert len(trace) == 36
        assert [t["head_version"] for t in trace[:4]] == ["v0001"] * 3 + ["v0002"]
        assert all(t["head"] == "shop" for t in trace)
        assert trace[3]["canary"]["arm"] == "candidate" and trace[3]["canary"]["share"] == 0.25
        assert trace[31]["canary"]["decision"] == "promote" and trace[31]["canary"]["figures"]["tau_diff_ci"][0] > 0
        assert "figures" not in trace[30]["canary"] and trace[-1]["canary"]["state"] == "promoted"
    finally:
        cur.stop()
        cand.stop()


def test_app_rolls_back_a_worse_candidate_and_rejects_it_in_the_registry(tmp_path, registry, caplog):
    cur, cand, ups = two_heads(lambda n: spec(15), lambda n: spec(5))
    caplog.set_level(logging.INFO, logger="cartspec.agent")
    try:
        with make_client(ups, tmp_path, canary=TRIAL) as c:
            rs = [post(c, "/v1/search", {"query": f"boots {i}"}) for i in range(16)]
            assert rs[15].headers["x-cartspec-canary"] == "candidate; state=rolled_back; n=4; decision=rollback"
            more = [post(c, "/v1/search", {"query": f"shoes {i}"}) for i in range(12)]
            assert len(cand.bodies) == 4 and all(r.headers["x-cartspec-route"].startswith("speculative")
                                                 for r in more)
            assert more[0].headers["x-cartspec-canary"] == "current; state=rolled_back; n=4"
            m = c.get("/metrics").text
            assert 'cartspec_canary_decisions_total{decision="rollback"} 1.0' in m
            assert 'cartspec_canary_state{state="rolled_back"} 1.0' in m and "cartspec_canary_share 0.0" in m
        assert registry.current().version == "v0001" and registry.get("v0002").status == "rejected"
        warned = [r for r in caplog.records if "canary: rollback" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
        assert "0.167 < 0.8 × current 0.500" in warned[0].getMessage()
    finally:
        cur.stop()
        cand.stop()


def test_a_failing_candidate_is_rolled_back_and_every_request_is_still_answered(tmp_path, registry):
    cur, cand, ups = two_heads(lambda n: spec(15), lambda n: spec(15))
    cand.status = 500
    try:
        with make_client(ups, tmp_path, canary=TRIAL) as c:
            rs = [post(c, "/v1/search", {"query": f"boots {i}"}) for i in range(20)]
            assert all(r.status_code == 200 for r in rs)  # the current head answered for the candidate
            assert rs[3].headers["x-cartspec-route"] == "speculative; reason=failover-candidate-error"
            assert rs[15].headers["x-cartspec-canary"].endswith("state=rolled_back; n=0; decision=rollback")
            assert len(cand.bodies) == 4
            m = c.get("/metrics").text
            assert 'cartspec_canary_errors_total{arm="candidate"} 4.0' in m
            assert 'cartspec_agent_upstream_errors_total{kind="http_500",target="candidate"} 4.0' in m
            info = c.get("/v1/info").json()["canary"]
            assert info["decision"] == {"decision": "rollback", "reason": "errors"}
        assert registry.get("v0002").status == "rejected"
        trace = read_trace(tmp_path / "trace.jsonl")
        assert trace[3]["route"] == "speculative" and trace[3]["head_version"] == "v0001"
        assert trace[3]["canary"]["arm"] == "current"  # the failover was answered (and counted) by the current
    finally:
        cur.stop()
        cand.stop()


def test_a_canary_without_registry_refs_decides_but_writes_no_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    cur, cand = Scripted(lambda n: spec(15)).start(), Scripted(lambda n: spec(2)).start()
    ups = Upstreams(speculative=Upstream(cur.url, label="eagle3-domain-g3"),
                    candidate=Upstream(cand.url, label="eagle3-new-g3"))
    try:
        with make_client(ups, tmp_path, canary=TRIAL) as c:
            for i in range(16):
                post(c, "/v1/search", {"query": f"boots {i}"})
            assert c.app.state.agent.canary.state == "rolled_back"
        assert not (tmp_path / "home" / "heads").exists()
    finally:
        cur.stop()
        cand.stop()


def test_the_fallback_watches_the_current_head_in_trial_and_the_candidate_once_promoted(tmp_path):
    cur, cand, ups = two_heads(lambda n: spec(11 + n % 3), lambda n: spec(19 + n % 3))
    plain = FakeUpstream().start()
    ups.by_target["plain"] = Upstream(plain.url, label="baseline")
    try:
        with make_client(ups, tmp_path, canary=TRIAL.model_copy(update={"registry": False}),
                         fallback=FallbackConfig(enabled=True, window_requests=64, min_requests=8)) as c:
            agent = c.app.state.agent
            for i in range(32):
                post(c, "/v1/search", {"query": f"boots {i}"})
            assert agent.canary.state == "promoted" and len(agent.fallback.window) == 24
            post(c, "/v1/search", {"query": "boots x"})
            assert len(agent.fallback.window) == 25 and agent.fallback.window._items[-1].accepted >= 19
            assert agent.router.targets == {"speculative", "plain"}
    finally:
        cur.stop()
        cand.stop()
        plain.stop()


# --- traffic recording -----------------------------------------------------------------------
def test_answered_requests_are_recorded_redacted_with_route_head_and_acceptance(tmp_path, registry):
    cur, cand, ups = two_heads(lambda n: spec(12), lambda n: spec(21))
    traffic = TrafficConfig(dir=tmp_path / "traffic", redact_patterns=[r"SKU-\d+"])
    try:
        with make_client(ups, tmp_path, canary=TRIAL, traffic=traffic) as c:
            for i in range(4):
                r = post(c, "/v1/search", {"query": f"boots {i} for jo.doe@example.com, SKU-4411{i}"})
                assert r.status_code == 200
            assert post(c, "/v1/search", {"query": "boots 0 for jo.doe@example.com, SKU-44110"}).headers[
                "x-cartspec-cache"] == "hit"  # a cache hit is no model answer: not recorded
            assert post(c, "/v1/search", {"query": ""}).status_code == 422  # nor is an error
        recs = read_traffic(tmp_path / "traffic")
        assert len(recs) == 4
        first, fourth = recs[0], recs[3]
        assert (first.task, first.route, first.deployment, first.head, first.head_version) == \
            ("search", "speculative", "eagle3-shop-g3", "shop", "v0001")
        assert (fourth.route, fourth.head_version, fourth.accepted, fourth.proposed, fourth.drafts) == \
            ("candidate", "v0002", 21, 30, 10)
        assert (first.accepted, first.proposed, first.drafts, first.gamma, first.output_tokens) == (12, 30, 10, 3, 25)
        assert first.tau == pytest.approx(2.2) and first.latency_ms > 0
        assert first.reply == SEARCH_JSON and first.temperature == 0.0 and first.structured is True
        text = json.dumps([r.model_dump(mode="json") for r in recs])
        assert "jo.doe@example.com" not in text and "SKU-4411" not in text
        assert first.redactions >= 2 and first.messages[-1]["role"] == "user"
        assert first.request().query == first.query and "boots 0" in first.query
    finally:
        cur.stop()
        cand.stop()


def test_a_failing_traffic_write_never_fails_the_request(tmp_path, caplog):
    fake = FakeUpstream().start()
    try:
        with make_client(fake, tmp_path, traffic=TrafficConfig(dir=tmp_path / "traffic")) as c:
            def broken(rec):
                raise OSError("No space left on device")

            c.app.state.agent.traffic.write = broken
            r = post(c, "/v1/search", {"query": "red boots"})
            assert r.status_code == 200 and r.json()["keywords"] == "running shoes"
        assert any("traffic record of request" in rec.getMessage() for rec in caplog.records)
    finally:
        fake.stop()


def test_traffic_is_off_by_default_and_info_never_shows_its_key():
    assert AgentConfig().traffic.dir is None
    public = AgentConfig.model_validate({"traffic": {"dir": "t", "redact_key": "secret"}}).public()
    assert "secret" not in json.dumps(public) and public["traffic"]["redact_key_set"] is True


# --- wiring -----------------------------------------------------------------------------------
def test_the_candidate_is_the_main_spec_with_the_head_swapped(tmp_path, registry):
    start = Starts()
    ups = build_upstreams(DOMAIN, start, canary_head="shop@v0002")
    main, cand = start.specs
    assert cand.speculative.model == "shop@v0002" and cand.label == "eagle3-shop@v0002-g3"
    assert cand.model_dump(exclude={"speculative"}) == main.model_dump(exclude={"speculative"})
    assert cand.speculative.model_dump(exclude={"model"}) == main.speculative.model_dump(exclude={"model"})
    assert set(ups.by_target) == {"speculative", "candidate"}
    assert ups["candidate"].head_ref == "shop@v0002" and ups["speculative"].head_ref is None
    assert candidate_head("shop") == ("shop@v0002", "shop@v0002")  # the newest candidate version
    with pytest.raises(ValueError, match="already the current version"):
        candidate_head("shop@v0001")
    head_dir = registry.get("v0002").path
    assert candidate_head(str(head_dir)) == (str(head_dir), "shop@v0002")
    # two targets of which one is a candidate: no router (it routes speculative against plain)
    assert apply_flags(AgentConfig(), ups).router.enabled is False
    assert apply_flags(AgentConfig(), ups, canary_share=0.2).canary.share == 0.2
    with pytest.raises(ValueError):
        apply_flags(AgentConfig(), ups, canary_share=0.9)


def test_a_canary_needs_a_speculative_main_deployment(registry):
    base = DOMAIN.model_copy(update={"speculative": Speculative()})
    with pytest.raises(ValueError, match="a canary needs a speculative main deployment"):
        build_upstreams(base, Starts(), canary_head="shop@v0002")
    ngram = DOMAIN.model_copy(update={"speculative": Speculative(method="ngram", num_speculative_tokens=3)})
    with pytest.raises(ValueError, match="drafts with a head"):
        canary_spec(ngram, "shop@v0002")
    with pytest.raises(ValueError, match="needs the main deployment's spec"):
        build_upstreams(None, Starts(), upstream="http://spec:8000", canary_head="shop@v0002")
    with pytest.raises(ValueError, match="speculative main deployment"):
        Upstreams(plain=Upstream("http://x"), candidate=Upstream("http://y"))
    with pytest.raises(ValueError, match="no head registry 'nope'"):
        candidate_head("nope@v0002")


def test_upstream_urls_get_their_keys(registry):
    ups = build_upstreams(None, Starts(), upstream="http://spec:8000", label="eagle3-domain-g3",
                          upstream_key="k-main", canary_upstream="http://cand:8000", canary_head="shop@v0002",
                          canary_key="k-cand")
    assert ups["speculative"].api_key == "k-main" and ups["candidate"].api_key == "k-cand"
    assert ups["candidate"].head_ref == "shop@v0002" and ups["candidate"].label == "candidate"
    assert ups["speculative"].gamma == 3


def test_serve_with_a_canary_upstream_keys_and_traffic_recording(tmp_path, registry):
    """The real command: both upstreams need a key; the canary and the recording come up and say so."""
    from cartspec.testing.trivial_server import FakeConfig, TrivialServer

    port = _free_port()
    env = {**os.environ, "CARTSPEC_UPSTREAM_KEY": "k-main"}
    with TrivialServer(FakeConfig(api_key="k-main", answer=lambda body: SEARCH_JSON)) as main, \
            TrivialServer(FakeConfig(api_key="k-cand", answer=lambda body: SEARCH_JSON)) as cand:
        proc = subprocess.Popen([sys.executable, "-m", "cartspec.cli", "serve", "--upstream", main.url,
                                 "--label", "eagle3-domain-g3", "--canary-upstream", cand.url, "--canary-key",
                                 "k-cand", "--canary-head", "shop@v0002", "--canary-share", "0.5",
                                 "--record-traffic", str(tmp_path / "traffic"), "--redact", r"SKU-\d+",
                                 "--port", str(port), "--trace", str(tmp_path / "t.jsonl")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            base = wait_ready(proc, port)
            info = httpx.get(base + "/v1/info").json()
            assert info["canary"]["state"] == "trial" and info["canary"]["every"] == 2
            assert info["canary"]["candidate"] == "shop@v0002"
            assert info["config"]["traffic"]["redact_patterns"] == [r"SKU-\d+"]
            rs = [httpx.post(base + "/v1/search", json={"query": f"boots SKU-{i}"}) for i in range(4)]
            assert [r.status_code for r in rs] == [200] * 4
            assert [r.headers["x-cartspec-route"].split(";")[0] for r in rs] == ["speculative", "candidate"] * 2
            assert main.counters.refused == [] and cand.counters.refused == []
            os.kill(proc.pid, signal.SIGINT)
            out, _ = proc.communicate(timeout=15)
            assert proc.returncode == 0
            assert "canary on (1 in 2 speculative requests to shop@v0002" in out
            assert "recording traffic to" in out
        finally:
            if proc.poll() is None:
                proc.kill()
    recs = read_traffic(tmp_path / "traffic")
    assert [r.route for r in recs] == ["speculative", "candidate"] * 2
    assert not any("SKU-" in r.query for r in recs)


def test_serve_refuses_a_canary_it_cannot_run_before_starting_anything(tmp_path, registry):
    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cartspec.cli", "serve", "--port", "0", *args],
                              capture_output=True, text=True, timeout=60)

    r = serve("--upstream", "http://127.0.0.1:9", "--canary-head", "nope@v2")
    assert r.returncode == 2 and "there is no head registry 'nope'" in " ".join(r.stderr.split())
    r = serve("--upstream", "http://127.0.0.1:9", "--label", "baseline", "--canary-upstream", "http://127.0.0.1:10")
    assert r.returncode == 2 and "a canary needs a speculative main deployment" in " ".join(r.stderr.split())
    r = serve("--upstream", "http://127.0.0.1:9", "--canary-head", "shop@v0001")
    assert r.returncode == 2 and "already the current version" in " ".join(r.stderr.split())


def test_a_registry_that_refuses_the_promotion_is_logged_and_the_decision_stands(tmp_path, registry, monkeypatch,
                                                                                 caplog):
    from cartspec.model.heads import HeadPinError, HeadRegistry

    def refuse(self, version, **kw):
        raise HeadPinError("pinned to another target")

    monkeypatch.setattr(HeadRegistry, "promote", refuse)
    cur, cand, ups = two_heads(lambda n: spec(11 + n % 3), lambda n: spec(19 + n % 3))
    try:
        with make_client(ups, tmp_path, canary=TRIAL) as c:
            rs = [post(c, "/v1/search", {"query": f"boots {i}"}) for i in range(32)]
            assert all(r.status_code == 200 for r in rs) and c.app.state.agent.canary.state == "promoted"
        assert registry.current().version == "v0001"
        failed = [r.getMessage() for r in caplog.records if "not written to the head registry" in r.getMessage()]
        assert failed == ["canary promote of shop@v0002 not written to the head registry: run "
                          "`cartspec heads promote shop@v0002` by hand"]
    finally:
        cur.stop()
        cand.stop()
