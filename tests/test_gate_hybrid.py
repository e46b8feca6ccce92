"""The gate compares the deployed drafter: the hybrid against the hybrid, each version with its own pointer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cartspec.draft.acceptance import AcceptanceReport
from cartspec.draft.classes import CLASSES
from cartspec.draft.gate import GateDecision, GateError, gate_reports
from cartspec.model.registry import BUNDLED_POINTER, POINTERS_DIR
from cartspec.paths import dir_digest
from test_gate import GAMMA, T0, _gate, _head_dir, _traffic, reqs


def _pointer(path, tag: str):
    """A pointer directory as `draft pointer` writes it (the files the deployment checks for)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"tag": tag}))
    (path / "pointer.safetensors").write_bytes(tag.encode())
    return path


def hybrid_report(replies, pointer: str, method: str = "hybrid", tokens: int = 50) -> AcceptanceReport:
    return AcceptanceReport.model_validate({
        "mode": "vllm", "method": method, "gamma": GAMMA, "target": "/m/commerce", "temperature": 0.0,
        "n": len(replies), "hybrid": ({"n_min": 3, "n_max": 4, "rule": "pointer", "scope": "prompt",
                                       "pointer": pointer, "head_p": 0.9} if method == "hybrid" else None),
        "replies": [{"id": i, "token_ids": list(range(tokens)), "per_step_accepted": acc} for i, acc in replies]})


def five_classes(rs, outs):
    """Ten tokens of each class, in CLASSES' order: every class is reached."""
    return [[CLASSES[min(t // 10, len(CLASSES) - 1)] for t in range(len(o))] for o in outs]


def test_hybrid_reports_are_gated_per_class_with_each_sides_pointer(tmp_path):
    own = _pointer(tmp_path / "v0002" / "pointer", "two")
    bundled = str(POINTERS_DIR / BUNDLED_POINTER)
    rng = np.random.default_rng(0)
    # replies of 100 tokens; both sides' steps reach past token 40 (free text)
    cand = hybrid_report([(f"r{i}", [int(x) for x in rng.integers(2, 4, 20)]) for i in range(40)], str(own), tokens=100)
    cur = hybrid_report([(f"r{i}", [int(x) for x in rng.integers(0, 3, 35)]) for i in range(40)], bundled, tokens=100)
    d = gate_reports(cand, cur, reqs(40), classify=five_classes, method="hybrid", candidate_ref="shop@v0002",
                     current_ref="shop@v0001")
    assert d.eligible and d.method == "hybrid" and d.n == 40
    # each side's pointer: a version's own by its digest, the one shipped with cartspec as "bundled"
    assert d.pointer_candidate == dir_digest(own, only=("config.json", "pointer.safetensors"))[:12]
    assert d.pointer_current == "bundled"
    # every class reached, with both sides' pooled acceptance and the interval of the difference
    assert [c.token_class for c in d.classes] == list(CLASSES)
    for c in d.classes:
        assert c.judged and c.candidate > c.current and c.ci_low is not None and c.ci_low > 0
    back = GateDecision.model_validate_json(d.to_json())
    assert (back.method, back.pointer_candidate, back.pointer_current) == ("hybrid", d.pointer_candidate, "bundled")


def test_a_report_of_another_method_than_asked_is_refused(tmp_path):
    rows = [(f"r{i}", [2, 1]) for i in range(5)]
    eagle = hybrid_report(rows, "", method="eagle3")
    with pytest.raises(GateError, match="measured with method 'eagle3', the gate was asked for 'hybrid'"):
        gate_reports(eagle, eagle, reqs(5), classify=five_classes, method="hybrid")
    hyb = hybrid_report(rows, str(POINTERS_DIR / BUNDLED_POINTER))
    with pytest.raises(GateError, match="the current's report was measured with method 'eagle3'"):
        gate_reports(hyb, eagle, reqs(5), classify=five_classes, method="hybrid")
    with pytest.raises(GateError, match="different methods"):
        gate_reports(hyb, eagle, reqs(5), classify=five_classes)
    other = hyb.model_copy(update={"hybrid": {**hyb.hybrid, "n_max": 6}})
    with pytest.raises(GateError, match="different lookups"):
        gate_reports(other, hyb, reqs(5), classify=five_classes, method="hybrid")


# --- the command ----------------------------------------------------------------------------------------------

@pytest.fixture
def registry(tmp_path, monkeypatch):
    """`shop`: v0001 current (no pointer of its own), v0002 a candidate that keeps its own pointer."""
    from cartspec.model.heads import HeadRegistry

    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    reg = HeadRegistry("shop")
    reg.add(_head_dir(tmp_path / "h1", "one"))
    h2 = _head_dir(tmp_path / "h2", "two")
    _pointer(h2 / "pointer", "two")
    reg.add(h2, parent="v0001", provenance={"data_window": {"first": T0, "until": T0 + 99, "n": 100}})
    return reg


def deployed_measure(calls: list):
    """measure_vllm's stand-in that records the drafter asked and the hybrid settings a deployment of the head
    resolves (``Speculative.hybrid_config``, as measure_vllm records them); v0002 accepts more."""
    from transformers import AutoTokenizer

    from cartspec.model.registry import resolve_head, resolve_model
    from cartspec.serving.spec import Speculative

    def measure(target, method, gamma, reqs, head=None, on_done=None, hybrid=None, **kw):
        calls.append((head, method, hybrid))
        model_dir, head_dir = resolve_model(target), resolve_head(head)
        tok = AutoTokenizer.from_pretrained(model_dir)
        rng = np.random.default_rng(len(head))
        replies = []
        for r in reqs:
            ids = tok('{"query": "%s", "page": 1}' % r.query, add_special_tokens=False).input_ids
            lo, hi = (2, 4) if head.endswith("v0002") else (0, 3)
            replies.append({"id": r.id, "token_ids": ids,
                            "per_step_accepted": [int(x) for x in rng.integers(lo, hi, max(1, len(ids) // 3))]})
        cfg = Speculative(method=method, model=str(head_dir), num_speculative_tokens=gamma,
                          hybrid=hybrid).hybrid_config(str(model_dir))
        return {"tau": 2.0, "mode": "vllm", "method": method, "gamma": gamma, "target": str(model_dir),
                "head": str(head_dir), "n": len(reqs), "temperature": 0.0, "max_tokens": kw["max_tokens"],
                "requests_without_step_metrics": 0, "replies": replies,
                "hybrid": cfg.__dict__ if cfg is not None else None}

    return measure


def test_gate_command_measures_the_hybrid_each_version_with_its_own_pointer(registry, tmp_path, tiny_llama_dir,
                                                                            monkeypatch):
    from cartspec.draft import acceptance

    calls: list = []
    monkeypatch.setattr(acceptance, "measure_vllm", deployed_measure(calls))
    traffic = _traffic(tmp_path / "traffic", 300)
    out = tmp_path / "decision.json"
    # no pointer was trained for the tiny target, but v0002 keeps its own: serve deploys it as the hybrid
    res = _gate(["--traffic", str(traffic), "--target", str(tiny_llama_dir), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert calls == [("shop@v0002", "hybrid", None), ("shop@v0001", "hybrid", None)]
    d = GateDecision.load(out)
    own = registry.get("v0002").path / "pointer"
    assert d.eligible and d.method == "hybrid"
    assert d.pointer_candidate == dir_digest(own, only=("config.json", "pointer.safetensors"))[:12]
    assert d.pointer_current is None  # v0001 has none and none was trained for the target: the head alone
    rep_c = AcceptanceReport.load(d.reports["candidate"])
    assert rep_c.hybrid["pointer"] == str(own) and rep_c.hybrid["rule"] == "pointer"
    assert AcceptanceReport.load(d.reports["current"]).hybrid["rule"] == "head"
    assert {c.token_class for c in d.classes} >= {"json_structure", "json_key", "value_copied"}
    assert "hybrid" in res.stdout and "value_copied" in res.stdout and "drafter: hybrid" in res.output

    # the same measurement again: reused; another method: measured again, beside the hybrid's reports
    calls.clear()
    res = _gate(["--traffic", str(traffic), "--target", str(tiny_llama_dir), "--method", "hybrid"])
    assert res.exit_code == 0 and calls == [] and res.output.count("reusing") == 2, res.output
    res = _gate(["--traffic", str(traffic), "--target", str(tiny_llama_dir), "--method", "eagle3"])
    assert res.exit_code == 0, res.output
    assert calls == [("shop@v0002", "eagle3", None), ("shop@v0001", "eagle3", None)]
    d = GateDecision.model_validate(registry.gate("v0002"))
    assert d.method == "eagle3" and d.pointer_candidate is None and d.pointer_current is None
    assert all((registry.get("v0002").path / f"gate-acceptance-{v}-hybrid.json").is_file()
               for v in ("v0001", "v0002"))
    res = _gate(["--traffic", str(traffic), "--target", str(tiny_llama_dir), "--method", "ngram"])
    assert res.exit_code == 2 and "--method must be eagle3 or hybrid" in res.output
