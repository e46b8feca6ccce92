"""Router policy: speculative vs plain by expected reply length and load; off by default."""

from __future__ import annotations

from cartspec.agent.config import AgentConfig, RouterConfig
from cartspec.agent.router import Router

BOTH = {"speculative", "plain"}
UP = {"speculative": True, "plain": True}


def router(**kw) -> Router:
    return Router(RouterConfig(enabled=True, **kw), BOTH)


def test_off_by_default_everything_goes_to_speculative():
    assert AgentConfig().router.enabled is False
    r = Router(RouterConfig(), BOTH)
    for task, load in (("search", 0), ("support", 100)):
        d = r.decide(task, "boots", load, UP)
        assert (d.target, d.reason) == ("speculative", "router-off")


def test_single_deployment_is_always_chosen():
    d = Router(RouterConfig(enabled=True), {"plain"}).decide("support", "x", 99, {"plain": False})
    assert (d.target, d.reason) == ("plain", "only-deployment")


def test_short_expected_replies_go_plain_long_ones_speculative():
    r = router(short_reply_tokens=50, prior_tokens={"search": 30, "support": 90})
    d = r.decide("search", "boots", 0, UP)
    assert (d.target, d.reason, d.expected_tokens) == ("plain", "short-reply", 30)
    d = r.decide("support", "refund?", 0, UP)
    assert (d.target, d.reason) == ("speculative", "long-reply")
    assert d.header() == "speculative; reason=long-reply"


def test_load_over_threshold_goes_plain():
    r = router(policy="load", max_speculative_inflight=8)
    assert r.decide("support", "x", 7, UP).target == "speculative"
    d = r.decide("support", "x", 8, UP)
    assert (d.target, d.reason) == ("plain", "load")


def test_length_policy_ignores_load_and_load_policy_ignores_length():
    assert router(policy="length", prior_tokens={"support": 90}).decide("support", "x", 1000, UP).target == "speculative"
    assert router(policy="load", prior_tokens={"search": 5}).decide("search", "x", 0, UP).target == "speculative"


def test_observed_lengths_move_the_estimate():
    r = router(short_reply_tokens=50, prior_tokens={"search": 40}, ema_alpha=0.5)
    assert r.decide("search", "red shoes", 0, UP).target == "plain"
    for _ in range(4):
        r.observe("search", "red shoes", 120)  # replies turn out long
    d = r.decide("search", "red shoes", 0, UP)
    assert d.target == "speculative" and d.expected_tokens > 100
    # a longer query sits in another bucket and still starts from the prior
    assert r.decide("search", " ".join(["word"] * 13), 0, UP).expected_tokens == 40


def test_failover_when_preferred_deployment_is_down():
    r = router(short_reply_tokens=50, prior_tokens={"support": 90})
    d = r.decide("support", "x", 0, {"speculative": False, "plain": True})
    assert (d.target, d.reason) == ("plain", "failover-speculative-down")
    d = r.decide("support", "x", 0, {"speculative": False, "plain": False})
    assert d.target == "speculative"  # nothing is up: the caller gets the 503 of the preferred one
