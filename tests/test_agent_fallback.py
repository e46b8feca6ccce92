"""Acceptance fallback: the state machine alone, then through the router and the app.

A draft head that stops matching the target must not keep slowing every
request down: below ``threshold`` traffic goes to the plain deployment, a
deterministic share keeps probing the speculative one, and traffic returns
once the probes accept above ``recover_threshold``.
"""

from __future__ import annotations

import logging

import pytest

from cartspec.agent import AgentConfig, Upstream, Upstreams
from cartspec.agent.acceptance import AcceptanceStats, pooled, reply_stats
from cartspec.agent.config import FallbackConfig, RouterConfig
from cartspec.agent.fallback import AcceptanceFallback
from cartspec.agent.router import Router
from cartspec.agent.trace import read_trace
from test_agent_app import FakeUpstream, make_client, post, upstream  # noqa: F401 - upstream is a fixture

UP = {"speculative": True, "plain": True}


def spec(accepted: int, drafted: int = 30, steps: int = 10) -> dict:
    """vLLM's per-request speculative metrics, as the agent reads them."""
    return {"num_spec_steps": steps, "num_draft_tokens": drafted, "num_accepted_draft_tokens": accepted,
            "draft_acceptance_rate": accepted / drafted if drafted else None}


def reply(accepted: int, drafted: int = 30) -> AcceptanceStats | None:
    return reply_stats(spec(accepted, drafted, steps=drafted // 3))


def machine(**kw) -> AcceptanceFallback:
    settings = dict(threshold=0.3, recover_threshold=0.5, window_requests=4, min_requests=3, probe_share=0.25)
    return AcceptanceFallback(FallbackConfig(**{**settings, **kw}))


# --- the state machine -------------------------------------------------------------
def test_low_acceptance_switches_to_fallback_only_after_min_requests():
    fb = machine()
    assert fb.observe(reply(1)) is None and fb.observe(reply(1)) is None  # 2 < min_requests: no verdict yet
    assert fb.state == "speculative"
    switch = fb.observe(reply(1))
    assert fb.state == "fallback"
    assert (switch.to, switch.direction, switch.observed, switch.threshold) == ("fallback", "to_fallback", 3, 0.3)
    assert switch.acceptance == pytest.approx(1 / 30)
    assert "0.033 < threshold 0.300 over 3" in switch.describe()


def test_good_acceptance_stays_speculative():
    fb = machine()
    for _ in range(20):
        assert fb.observe(reply(20)) is None
    assert fb.state == "speculative" and fb.window.rate == pytest.approx(20 / 30)


def test_fallback_probes_exactly_the_configured_share():
    fb = machine(probe_share=0.25)
    for _ in range(3):
        fb.observe(reply(0))
    probes = [fb.route().probe for _ in range(12)]
    assert probes == [False, False, False, True] * 3  # every 4th: reproducible, no coin
    fb10 = machine(probe_share=0.1)
    for _ in range(3):
        fb10.observe(reply(0))
    assert sum(fb10.route().probe for _ in range(100)) == 10
    assert not any(machine().route().probe for _ in range(10))  # no probes while speculating


def test_recovers_when_probes_accept_above_recover_threshold():
    fb = machine()
    for _ in range(3):
        fb.observe(reply(0))
    assert fb.state == "fallback" and len(fb.window) == 0  # recovery is judged on new replies only
    assert fb.observe(reply(27)) is None and fb.observe(reply(27)) is None  # not enough probes yet
    switch = fb.observe(reply(27))
    assert fb.state == "speculative" and switch.direction == "to_speculative"
    assert switch.acceptance == pytest.approx(0.9) and switch.threshold == 0.5
    assert "0.900 > recover_threshold 0.500" in switch.describe()


def test_acceptance_between_the_thresholds_never_flaps():
    fb = machine()
    for _ in range(50):  # 0.4: under recover_threshold, over threshold
        assert fb.observe(reply(12)) is None
    assert fb.state == "speculative"
    for _ in range(3):
        fb.observe(reply(0))
    assert fb.state == "fallback"
    for _ in range(50):
        assert fb.observe(reply(12)) is None
    assert fb.state == "fallback"


def test_replies_without_drafts_are_not_observations():
    assert reply_stats(None) is None and reply_stats({}) is None
    assert reply_stats(spec(0, drafted=0, steps=0)) is None
    fb = machine()
    for _ in range(10):
        assert fb.observe(reply_stats(spec(0, drafted=0, steps=0))) is None
        assert fb.observe(None) is None
    assert fb.state == "speculative" and len(fb.window) == 0 and fb.window.rate is None


def test_rolling_acceptance_is_token_weighted_over_the_last_window_replies():
    fb = machine(window_requests=3, min_requests=3, threshold=0.0, recover_threshold=1.0)  # never switches
    fb.observe(reply(0, drafted=300))  # pushed out of the window by the next three
    for accepted, drafted in ((3, 3), (0, 30), (15, 30)):
        fb.observe(reply(accepted, drafted))
    assert fb.window.rate == pytest.approx(18 / 63)
    assert pooled([reply(3, 3), reply(0, 30), reply(15, 30)]).rate == pytest.approx(18 / 63)


def test_fallback_config_needs_hysteresis():
    with pytest.raises(ValueError, match="recover_threshold"):
        FallbackConfig(threshold=0.5, recover_threshold=0.5)
    with pytest.raises(ValueError, match="min_requests"):
        FallbackConfig(window_requests=4, min_requests=5)
    assert FallbackConfig().enabled is None  # auto: on exactly when there is a plain deployment


# --- the router ----------------------------------------------------------------------
def test_router_sends_all_but_probes_to_plain_during_fallback_whatever_the_policy():
    fb = machine(probe_share=0.5)
    r = Router(RouterConfig(enabled=True, prior_tokens={"support": 90}), {"speculative", "plain"}, fb)
    d = r.decide("support", "refund?", 0, UP)
    assert (d.target, d.reason) == ("speculative", "long-reply") and d.fallback.state == "speculative"
    assert d.header() == "speculative; reason=long-reply"
    for _ in range(3):
        fb.observe(reply(1))
    decisions = [r.decide("support", "refund?", 0, UP) for _ in range(4)]
    assert [(d.target, d.reason) for d in decisions] == [("plain", "acceptance-fallback"),
                                                         ("speculative", "acceptance-probe")] * 2
    assert decisions[0].header() == "plain; reason=acceptance-fallback; acceptance=0.033"
    assert decisions[1].header() == "speculative; reason=acceptance-probe; acceptance=0.033"
    assert decisions[1].fallback.probe and not decisions[0].fallback.probe
    assert decisions[1].fallback.state == "fallback" and decisions[1].fallback.observed == 0


def test_fallback_still_avoids_a_deployment_that_is_down():
    fb = machine(probe_share=1.0)  # every request a probe
    r = Router(RouterConfig(), {"speculative", "plain"}, fb)
    for _ in range(3):
        fb.observe(reply(0))
    d = r.decide("search", "boots", 0, {"speculative": False, "plain": True})
    assert (d.target, d.reason) == ("plain", "failover-speculative-down") and d.fallback.state == "fallback"
    fb2 = machine()
    r2 = Router(RouterConfig(), {"speculative", "plain"}, fb2)
    for _ in range(3):
        fb2.observe(reply(0))
    d = r2.decide("search", "boots", 0, {"speculative": True, "plain": False})
    assert (d.target, d.reason) == ("speculative", "failover-plain-down")


# --- through the app: headers, metrics, trace, log -----------------------------------------
def test_agent_falls_back_to_plain_probes_and_returns_with_headers_metrics_trace_and_log(tmp_path, caplog):
    spec_fake, plain_fake = FakeUpstream().start(), FakeUpstream().start()
    spec_fake.spec = spec(1)       # a mismatched head: 1 of 30 drafted tokens accepted
    plain_fake.spec = None         # no speculation there
    caplog.set_level(logging.INFO, logger="cartspec.agent")
    try:
        ups = Upstreams(speculative=Upstream(spec_fake.url, label="eagle3-generic-g3"),
                        plain=Upstream(plain_fake.url, label="baseline"))
        fallback = FallbackConfig(threshold=0.3, recover_threshold=0.5, window_requests=4, min_requests=3,
                                  probe_share=0.5)
        with make_client(ups, tmp_path, fallback=fallback) as c:
            heads = [post(c, "/v1/search", {"query": f"boots {i}"}).headers["x-cartspec-route"] for i in range(3)]
            assert heads == ["speculative; reason=router-off"] * 3
            m = c.get("/metrics").text
            assert 'cartspec_agent_fallback_switches_total{direction="to_fallback",target="speculative"} 1.0' in m
            assert 'cartspec_agent_fallback_state{target="speculative"} 1.0' in m
            switched = [r for r in caplog.records if r.name == "cartspec.agent" and "fallback" in r.getMessage()]
            assert len(switched) == 1 and switched[0].levelno == logging.WARNING
            assert "0.033 < threshold 0.300 over 3" in switched[0].getMessage()
            assert "eagle3-generic-g3" in switched[0].getMessage()

            r = post(c, "/v1/search", {"query": "boots 3"})
            assert r.headers["x-cartspec-route"] == "plain; reason=acceptance-fallback; acceptance=0.033"
            assert r.headers["x-cartspec-deployment"] == "baseline"
            r = post(c, "/v1/search", {"query": "boots 4"})
            assert r.headers["x-cartspec-route"].startswith("speculative; reason=acceptance-probe")
            assert len(spec_fake.bodies) == 4 and len(plain_fake.bodies) == 1

            spec_fake.spec = spec(27)  # the domain head is back: probes accept 90%
            for i in range(5, 11):
                post(c, "/v1/search", {"query": f"boots {i}"})
            m = c.get("/metrics").text
            assert 'cartspec_agent_fallback_switches_total{direction="to_speculative",target="speculative"} 1.0' in m
            assert 'cartspec_agent_fallback_state{target="speculative"} 0.0' in m
            assert 'cartspec_agent_route_decisions_total{endpoint="search",reason="acceptance-fallback",target="plain"} 3.0' in m
            assert post(c, "/v1/search", {"query": "boots 11"}).headers["x-cartspec-route"] == \
                "speculative; reason=router-off"
        recovered = [r for r in caplog.records if "acceptance recovered" in r.getMessage()]
        # the first probe still met the old head: (1 + 27 + 27) / 90
        assert len(recovered) == 1 and "0.611 > recover_threshold 0.500 over 3" in recovered[0].getMessage()
        trace = read_trace(tmp_path / "trace.jsonl")
        assert [t["route_reason"] for t in trace] == (["router-off"] * 3
                                                      + ["acceptance-fallback", "acceptance-probe"] * 3
                                                      + ["router-off"] * 3)
        assert trace[0]["fallback"] == {"state": "speculative", "observed": 0, "probe": False}
        assert trace[2]["fallback"] == {"state": "speculative", "acceptance": pytest.approx(1 / 30), "observed": 2,
                                        "probe": False}
        # right after the switch the rate that caused it stands until probes bring their own
        assert trace[3]["fallback"] == {"state": "fallback", "acceptance": pytest.approx(1 / 30), "observed": 0,
                                        "probe": False}
        assert trace[4]["fallback"]["probe"] is True and trace[4]["route"] == "speculative"
        assert trace[-1]["fallback"]["state"] == "speculative" and trace[-1]["fallback"]["acceptance"] == 0.9
    finally:
        spec_fake.stop()
        plain_fake.stop()


def test_fallback_is_off_with_one_deployment_and_when_disabled(upstream, tmp_path):
    with make_client(upstream, tmp_path, fallback=FallbackConfig(enabled=True)) as c:
        assert c.app.state.agent.fallback is None  # nothing to fall back to
        assert "cartspec_agent_fallback_state{" not in c.get("/metrics").text
    ups = Upstreams(speculative=Upstream(upstream.url), plain=Upstream(upstream.url, label="baseline"))
    assert make_client(ups, tmp_path).app.state.agent.fallback is not None  # default: on with two
    assert make_client(ups, tmp_path, fallback=FallbackConfig(enabled=False)).app.state.agent.fallback is None
    assert AgentConfig().fallback.enabled is None
