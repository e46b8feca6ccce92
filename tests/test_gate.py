"""The offline gate's decision on constructed acceptance data with known answers, and the command's wiring."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cartspec.draft.acceptance import AcceptanceReport
from cartspec.draft.gate import (ClassGate, GateDecision, GateError, RequestCounts, counts_from_reply, decide,
                                 gate_reports, t_interval, t_quantile)
from cartspec.task.data import Request

GAMMA = 3


def counts(n: int, tau: float, value_copied: float = 0.5, seed: int = 0, steps: int = 20,
           jitter: int = 3) -> list[RequestCounts]:
    """n replies whose τ is about ``tau`` (±jitter accepted per reply) and value_copied acceptance exactly
    ``value_copied`` on 10 reached drafts per reply; free_text at 0.5 on 20."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        acc = int(round((tau - 1) * steps)) + int(rng.integers(-jitter, jitter + 1))
        out.append(RequestCounts(steps=steps, accepted=max(0, min(acc, GAMMA * steps)),
                                 classes={"value_copied": (10, int(round(10 * value_copied))),
                                          "free_text": (20, 10)}))
    return out


def test_clearly_better_is_eligible():
    d = decide(counts(60, 3.2, seed=1), counts(60, 2.8, seed=2), gamma=GAMMA, candidate_ref="shop@v0002",
               current_ref="shop@v0001")
    assert d.eligible
    assert d.n == 60 and d.requests == 60 and d.left_out == 0
    assert d.ci_low > 0 and d.ci_low < d.diff < d.ci_high
    assert d.t_low > 0 and d.t_low < d.diff < d.t_high
    assert abs(d.diff - 0.4) < 0.05
    assert d.reasons[0].startswith(f"τ {d.tau_candidate:.2f} vs {d.tau_current:.2f}: +0.")
    assert d.reasons[0].endswith("above 0") and "not above" not in d.reasons[0]
    assert "no token class worse" in d.reasons[-1]
    assert (d.candidate, d.current, d.gamma) == ("shop@v0002", "shop@v0001", GAMMA)
    vc = next(c for c in d.classes if c.token_class == "value_copied")
    assert (vc.reached_candidate, vc.accepted_candidate, vc.candidate) == (600, 300, 0.5)
    assert vc.diff == 0 and vc.judged and not vc.worse


def test_equal_heads_are_not_eligible():
    same = counts(60, 3.0, seed=3)
    d = decide(same, same, gamma=GAMMA)
    assert not d.eligible
    assert d.diff == 0 and (d.ci_low, d.ci_high) == (0, 0)
    assert "not above 0" in d.reasons[0]
    # equal in distribution, not in every reply: the interval straddles 0
    d = decide(counts(80, 3.0, seed=4), counts(80, 3.0, seed=5), gamma=GAMMA)
    assert not d.eligible and d.ci_low < 0 < d.ci_high


def test_better_tau_but_a_class_clearly_worse_is_not_eligible():
    d = decide(counts(60, 3.2, value_copied=0.2, seed=1), counts(60, 2.8, value_copied=0.6, seed=2), gamma=GAMMA)
    assert d.ci_low > 0  # τ alone would pass
    assert not d.eligible
    vc = next(c for c in d.classes if c.token_class == "value_copied")
    assert vc.worse and vc.ci_high < 0 and math.isclose(vc.diff, -0.4)
    ft = next(c for c in d.classes if c.token_class == "free_text")
    assert not ft.worse
    worse = [r for r in d.reasons if r.startswith("class ")]
    assert worse == [f"class value_copied worse: -0.40 [-0.40, -0.40] (0.600 -> 0.200)"]


def test_a_class_worse_within_its_interval_does_not_block():
    rng = np.random.default_rng(7)
    cand, cur = counts(60, 3.2, seed=1), counts(60, 2.8, seed=2)
    # value_copied: candidate a little lower on average, noisy per request -> interval straddles 0
    for c, u in zip(cand, cur):
        c.classes["value_copied"] = (10, int(rng.integers(2, 9)))
        u.classes["value_copied"] = (10, int(rng.integers(2, 10)))
    d = decide(cand, cur, gamma=GAMMA)
    vc = next(c for c in d.classes if c.token_class == "value_copied")
    assert vc.ci_low < 0 < vc.ci_high and not vc.worse
    assert d.eligible


def test_too_few_requests_is_not_eligible():
    d = decide(counts(12, 3.4, seed=1), counts(12, 2.6, seed=2), gamma=GAMMA)
    assert d.ci_low > 0  # clearly better, but on 12 requests
    assert not d.eligible
    assert any("only 12 paired requests" in r and "30" in r for r in d.reasons)
    assert decide(counts(12, 3.4, seed=1), counts(12, 2.6, seed=2), min_requests=10).eligible


def test_replies_without_steps_are_left_out_of_the_pairs():
    cand, cur = counts(40, 3.2, seed=1), counts(40, 2.8, seed=2)
    cand[0] = RequestCounts()  # drafted nothing (a one-token reply, or no step metrics)
    d = decide(cand, cur, gamma=GAMMA)
    assert (d.requests, d.n, d.left_out) == (40, 39, 1)
    assert d.reasons[0].startswith("1 of 40 requests left out")
    empty = decide([RequestCounts()] * 3, [RequestCounts()] * 3)
    assert not empty.eligible and empty.diff is None and empty.n == 0


def test_small_classes_are_shown_but_not_judged():
    cand, cur = counts(60, 3.2, seed=1), counts(60, 2.8, seed=2)
    cand[0].classes["json_key"] = (3, 0)  # worse in the one request that reached it
    cur[0].classes["json_key"] = (3, 3)
    d = decide(cand, cur, gamma=GAMMA)
    jk = next(c for c in d.classes if c.token_class == "json_key")
    assert jk.requests == 1 and not jk.judged and not jk.worse
    assert d.eligible and "json_key" in d.reasons[-1]


def test_the_bootstrap_is_seeded():
    a, b = counts(50, 3.1, seed=1), counts(50, 3.0, seed=2)
    d1, d2 = decide(a, b, seed=3), decide(a, b, seed=3)
    assert (d1.ci_low, d1.ci_high) == (d2.ci_low, d2.ci_high)
    assert [c.ci_low for c in d1.classes] == [c.ci_low for c in d2.classes]
    d3 = decide(a, b, seed=4)
    assert (d3.ci_low, d3.ci_high) != (d1.ci_low, d1.ci_high)
    assert (d3.t_low, d3.t_high) == (d1.t_low, d1.t_high)


def test_t_interval_against_known_quantiles():
    assert math.isclose(t_quantile(0.975, 1), 12.7062047, rel_tol=1e-6)
    assert math.isclose(t_quantile(0.975, 9), 2.2621572, rel_tol=1e-6)
    assert math.isclose(t_quantile(0.975, 29), 2.0452296, rel_tol=1e-6)
    assert math.isclose(t_quantile(0.025, 29), -2.0452296, rel_tol=1e-6)
    lo, hi = t_interval([1.0, 2.0, 3.0, 4.0])  # mean 2.5, sd 1.29099, t(3) 3.182446
    assert math.isclose(lo, 2.5 - 3.182446 * 1.2909944 / 2, rel_tol=1e-6)
    assert math.isclose(hi, 2.5 + 3.182446 * 1.2909944 / 2, rel_tol=1e-6)
    assert t_interval([1.0]) is None


def test_decision_round_trips_json(tmp_path):
    d = decide(counts(40, 3.2, value_copied=0.2, seed=1), counts(40, 2.8, value_copied=0.6, seed=2), gamma=GAMMA,
               candidate_ref="shop@v0002", current_ref="shop@v0001")
    assert GateDecision.load(d.save(tmp_path / "gate.json")) == d
    assert all(isinstance(c, ClassGate) for c in GateDecision.model_validate_json(d.to_json()).classes)


# --- from AcceptanceReports ---------------------------------------------------------------------------------

def test_counts_from_reply_places_steps_on_tokens():
    # tokens 0..9; token 0 from prefill; each step drafts γ=3 after the newest token
    classes = ["free_text"] * 4 + ["value_copied"] * 6
    c = counts_from_reply([3, 1, 0], classes, GAMMA)
    # step 1 drafts 1,2,3: all accepted (reached 3, accepted 3), then bonus 4
    # step 2 drafts 5,6,7: 5 accepted, 6 rejected (reached 2, accepted 1), 6 is the target's
    # step 3 drafts 7,8,9: 7 rejected (reached 1, accepted 0)
    assert (c.steps, c.accepted, c.tau) == (3, 4, 1 + 4 / 3)
    assert c.classes == {"free_text": (3, 3), "value_copied": (3, 1)}
    assert counts_from_reply(None, classes, GAMMA) == RequestCounts()


def report(replies: list[tuple[str | None, list[int]]], gamma: int = GAMMA, target: str = "/m/commerce",
           tokens: int = 40) -> AcceptanceReport:
    return AcceptanceReport.model_validate({
        "mode": "vllm", "method": "eagle3", "gamma": gamma, "target": target, "temperature": 0.0,
        "n": len(replies),
        "replies": [{"id": i, "token_ids": list(range(tokens)), "per_step_accepted": acc} for i, acc in replies]})


def reqs(n: int, ids: bool = True) -> list[Request]:
    return [Request(query=f"red shoes size {i}", id=f"r{i}" if ids else None) for i in range(n)]


def classify(rs, outs):
    """Tokens 0-9 free text, then value_copied: no tokenizer needed."""
    return [["free_text"] * 10 + ["value_copied"] * (len(o) - 10) for o in outs]


def test_gate_reports_pairs_by_id_and_decides():
    rng = np.random.default_rng(0)
    cand = [(f"r{i}", [int(x) for x in rng.integers(2, 4, 10)]) for i in range(40)]
    cur = [(f"r{i}", [int(x) for x in rng.integers(0, 3, 12)]) for i in range(40)]
    cur.reverse()  # another order: paired by id
    d = gate_reports(report(cand), report(cur), reqs(40), classify=classify, candidate_ref="shop@v0002",
                     current_ref="shop@v0001")
    assert d.eligible and d.n == 40 and d.gamma == GAMMA and d.replies_differ == 0
    exp = np.mean([(1 + sum(a) / len(a)) - (1 + sum(b) / len(b)) for (_, a), (_, b) in zip(cand, reversed(cur))])
    assert math.isclose(d.diff, exp)
    assert {c.token_class for c in d.classes} == {"free_text", "value_copied"}


def test_gate_reports_pairs_by_position_without_ids():
    cand = [(None, [3, 3, 2]) for _ in range(30)]
    cur = [(None, [1, 1, 0]) for _ in range(30)]
    d = gate_reports(report(cand), report(cur), reqs(30, ids=False), classify=classify)
    assert d.n == 30 and math.isclose(d.diff, 8 / 3 - 2 / 3) and d.eligible


def test_gate_reports_refuses_what_cannot_be_compared():
    r3 = report([(f"r{i}", [1]) for i in range(5)])
    with pytest.raises(GateError, match="different γ"):
        gate_reports(report([(f"r{i}", [1]) for i in range(5)], gamma=5), r3, reqs(5), classify=classify)
    with pytest.raises(GateError, match="different targets"):
        gate_reports(report([(f"r{i}", [1]) for i in range(5)], target="/m/base"), r3, reqs(5), classify=classify)
    with pytest.raises(GateError, match="request sets differ"):
        gate_reports(report([(f"x{i}", [1]) for i in range(5)]), r3, reqs(5), classify=classify)
    with pytest.raises(GateError, match="request sets differ"):
        gate_reports(report([(f"r{i}", [1]) for i in range(4)]), r3, reqs(5), classify=classify)
    with pytest.raises(GateError, match="asked for γ=5"):
        gate_reports(r3, r3, reqs(5), classify=classify, gamma=5)
    sim = AcceptanceReport.model_validate({"mode": "simulate", "gamma": GAMMA, "target": "/m/commerce"})
    with pytest.raises(GateError, match="no per-reply steps"):
        gate_reports(sim, r3, reqs(5), classify=classify)


# --- the command ----------------------------------------------------------------------------------------------

T0 = 1_800_000_000.0


def _head_dir(path, tag: str):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], "tag": "%s"}\n' % tag)
    (path / "model.safetensors").write_bytes(tag.encode())
    return path


def _traffic(dir_, n: int, t0: float = T0):
    """n records one second apart, each a different query; the last repeats the first's words."""
    from cartspec.task.traffic import TrafficRecord

    dir_.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        q = f"red running shoes size {i % (n - 1) if i == n - 1 else i}" if n > 1 else "red running shoes"
        lines.append(TrafficRecord(id=f"req-{i}", ts=t0 + i, task="search", query=q, history=[],
                                   messages=[{"role": "user", "content": q}], reply='{"query": "%s"}' % q,
                                   temperature=0.0, structured=False, gamma=GAMMA).model_dump_json())
    (dir_ / "traffic-20270115T080000-1.jsonl").write_text("\n".join(lines) + "\n")
    return dir_


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A registry `shop` with v0001 current and v0002 a candidate trained on traffic up to T0 + 99."""
    from cartspec.model.heads import HeadRegistry

    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    reg = HeadRegistry("shop")
    reg.add(_head_dir(tmp_path / "h1", "one"))
    reg.add(_head_dir(tmp_path / "h2", "two"), parent="v0001",
            provenance={"data_window": {"first": T0, "until": T0 + 99, "n": 100}})
    return reg


def fake_measure(better: str = "shop@v0002", calls: list | None = None, worse_class: bool = False):
    """measure_vllm's stand-in: the `better` head accepts 2-3 of γ=3 per step, the other 0-2; replies are the
    tokens of a JSON echo of the query, so token classes come from the real tokenizer."""
    from transformers import AutoTokenizer

    from cartspec.model.registry import resolve_head, resolve_model

    def measure(target, method, gamma, reqs, head=None, on_done=None, **kw):
        if calls is not None:
            calls.append(head)
        tok = AutoTokenizer.from_pretrained(resolve_model(target))
        rng = np.random.default_rng(len(head or ""))
        replies = []
        for i, r in enumerate(reqs):
            ids = tok('{"query": "%s", "page": 1}' % r.query, add_special_tokens=False).input_ids
            lo, hi = (2, 4) if head == better else (0, 3)
            acc = [int(x) for x in rng.integers(lo, hi, max(1, len(ids) // 3))]
            replies.append({"id": r.id, "token_ids": ids, "per_step_accepted": acc})
            if on_done:
                on_done(i + 1, len(reqs))
        return {"tau": 2.0, "mode": "vllm", "method": method, "gamma": gamma, "target": str(resolve_model(target)),
                "head": str(resolve_head(head)), "n": len(reqs), "temperature": 0.0, "max_tokens": kw["max_tokens"],
                "requests_without_step_metrics": 0, "replies": replies}

    return measure


def _gate(args):
    from typer.testing import CliRunner

    from cartspec.cli import app

    return CliRunner().invoke(app, ["draft", "gate", "--head", "shop", "--candidate", "v0002", *args])


def test_gate_command_measures_both_heads_and_writes_the_decision(registry, tmp_path, tiny_llama_dir,
                                                                   monkeypatch):
    from cartspec.draft import acceptance

    calls: list = []
    monkeypatch.setattr(acceptance, "measure_vllm", fake_measure(calls=calls))
    traffic = _traffic(tmp_path / "traffic", 300)
    out = tmp_path / "decision.json"
    res = _gate(["--traffic", str(traffic), "--target", str(tiny_llama_dir), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert calls == ["shop@v0002", "shop@v0001"]  # candidate first, then current
    d = GateDecision.load(out)
    assert d.eligible and (d.candidate, d.current, d.gamma) == ("shop@v0002", "shop@v0001", GAMMA)
    # the most recent 20% of 299 distinct requests: ts T0+240..T0+299, all after the candidate's training
    # window (until T0+99); but the last record repeats req-0's words, trained on: left out
    h = d.held_out
    assert (h.records, h.held_out, h.left_out_trained, h.requests) == (299, 60, 1, 59)
    assert h.after == T0 + 99 and h.served_gamma == [GAMMA]
    gate_json = registry.gate("v0002")
    assert GateDecision.model_validate(gate_json) == d
    for side, v in (("candidate", "v0002"), ("current", "v0001")):
        p = registry.get("v0002").path / f"gate-acceptance-{v}.json"
        assert d.reports[side] == str(p)
        assert [x.id for x in AcceptanceReport.load(p).replies] == [f"req-{i}" for i in range(240, 299)]
    assert "eligible" in res.stdout and "τ" in res.stdout and "held out the most recent 20%" in res.output
    assert registry.get("v0002").status == "candidate"  # the gate decides; promotion is `heads promote`'s

    # a rerun with the same requests reuses the measured reports
    calls.clear()
    res = _gate(["--traffic", str(traffic), "--target", str(tiny_llama_dir)])
    assert res.exit_code == 0, res.output
    assert calls == [] and res.output.count("reusing") == 2


def test_gate_command_not_eligible_exits_0(registry, tmp_path, tiny_llama_dir, monkeypatch):
    from cartspec.draft import acceptance

    monkeypatch.setattr(acceptance, "measure_vllm", fake_measure(better="shop@v0001"))
    res = _gate(["--traffic", str(_traffic(tmp_path / "traffic", 300)), "--target", str(tiny_llama_dir)])
    assert res.exit_code == 0, res.output
    d = GateDecision.model_validate(registry.gate("v0002"))
    assert not d.eligible and d.ci_high < 0
    assert "not eligible" in res.stdout


def test_gate_command_leaves_out_what_the_candidate_trained_on(registry, tmp_path, tiny_llama_dir, monkeypatch):
    from cartspec.draft import acceptance

    calls: list = []
    monkeypatch.setattr(acceptance, "measure_vllm", fake_measure(calls=calls))
    # 150 distinct requests from T0-29 to T0+120 (the last repeats the first's words): the held-out half
    # (T0+46..T0+120) reaches back before the training window's end (T0+99): 54 records trained on are left
    # out, and the last, which repeats a trained request
    traffic = _traffic(tmp_path / "traffic", 151, t0=T0 - 30)
    res = _gate(["--traffic", str(traffic), "--target", str(tiny_llama_dir), "--held-out", "0.5"])
    assert res.exit_code == 0, res.output
    d = GateDecision.model_validate(registry.gate("v0002"))
    h = d.held_out
    assert h.records == 150 and h.held_out == 75
    assert h.left_out_trained == 55 and h.requests == 20 and h.first_ts == T0 + 100
    assert calls == []  # 20 < min_requests: not measured
    assert not d.eligible and "only 20 held-out requests" in d.reasons[0]


def test_gate_command_refuses_a_missing_registry_or_version(registry, tmp_path):
    from typer.testing import CliRunner

    from cartspec.cli import app

    traffic = _traffic(tmp_path / "traffic", 10)
    res = CliRunner().invoke(app, ["draft", "gate", "--head", "nope", "--candidate", "v0002", "--traffic",
                                   str(traffic)])
    assert res.exit_code == 2 and "no head registry 'nope'" in res.output
    res = CliRunner().invoke(app, ["draft", "gate", "--head", "shop", "--candidate", "v0009", "--traffic",
                                   str(traffic)])
    assert res.exit_code == 2 and "no version v0009" in res.output
    res = CliRunner().invoke(app, ["draft", "gate", "--head", "shop", "--candidate", "v0001", "--traffic",
                                   str(traffic)])
    assert res.exit_code == 2 and "is the current version" in res.output
    res = _gate(["--traffic", str(traffic), "--held-out", "1.5"])
    assert res.exit_code == 2 and "--held-out is a share" in res.output
    res = _gate(["--traffic", str(tmp_path / "none")])
    assert res.exit_code == 2 and "no traffic at" in res.output


def test_gate_reports_classifies_each_side_on_its_own_tokens():
    seen = []

    def cls(rs, outs):
        seen.append(len(outs))
        return [["value_copied" if t >= 100 else "free_text" for t in o] for o in outs]

    cand = report([(f"r{i}", [3, 3]) for i in range(30)])
    cur = report([(f"r{i}", [3, 3]) for i in range(30)])
    for x in cur.replies[:5]:  # these replies drafted over other tokens: value_copied, not free_text
        x.token_ids = [100 + t for t in x.token_ids]
    d = gate_reports(cand, cur, reqs(30), classify=cls, min_class_requests=1)
    assert d.replies_differ == 5 and seen == [30, 5]  # only the differing replies are classified again
    vc = next(c for c in d.classes if c.token_class == "value_copied")
    assert (vc.reached_candidate, vc.reached_current) == (0, 5 * 6)
