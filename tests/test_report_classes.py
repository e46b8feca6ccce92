"""Acceptance per token class in the study report, from per-step counts and re-tokenised replies."""

from __future__ import annotations

import json

from cartspec.results import DeploymentInfo, PointConfig, PointResult, RequestRecord
from cartspec.analysis.classes import acceptance_by_class, reply_ids
from cartspec.report.classes import by_class_html


def _point(tmp_path, tokenizer_dir, records, method="hybrid"):
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text(json.dumps({"id": "r1", "query": "red trail runners from brooks"}) + "\n")
    cfg = PointConfig(deployment=f"{method}-domain-g3", method=method, gamma=3, request_set=str(reqs), n_requests=1,
                      concurrency=1)
    info = DeploymentInfo(label=cfg.deployment, method=method, model="x", versions={"model_dir": str(tokenizer_dir)})
    return PointResult.measured(cfg, records, 1.0, deployment=info)


def test_all_accepted_and_none_accepted(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = '{"intent": "search", "keywords": "trail runners", "brands_include": ["brooks"], "colors": ["red"]}'
    ids = reply_ids(tok, text, len(tok(text, add_special_tokens=False).input_ids) + 1)
    assert ids is not None and ids[-1] == tok.eos_token_id
    n = len(ids)
    steps = (n - 1) // 4  # every step: 3 accepted + the bonus token
    good = RequestRecord(id="r1", text=text, output_tokens=n,
                         request_spec_metrics={"per_step_accepted": [3] * steps, "per_step_drafted": [3] * steps})
    rows = acceptance_by_class([_point(tmp_path, tokenizer_dir, [good])])
    assert len(rows) == 1 and rows[0].replies == 1 and rows[0].tau == 4.0
    assert {c: v for c, v in rows[0].by_class.items() if v is not None} == {
        "json_structure": 1.0, "json_key": 1.0, "value_copied": 1.0, "value_not_in_request": 1.0}
    bad = good.model_copy(update={"request_spec_metrics": {"per_step_accepted": [0] * (n - 1),
                                                          "per_step_drafted": [3] * (n - 1)}})
    row = acceptance_by_class([_point(tmp_path, tokenizer_dir, [bad])])[0]
    assert row.tau == 1.0 and all(v in (0.0, None) for v in row.by_class.values())
    assert "by-class" in by_class_html([row])


def test_a_reply_that_retokenises_differently_is_skipped_not_misplaced(tmp_path, tokenizer_dir):
    text = '{"intent": "search"}'
    rec = RequestRecord(id="r1", text=text, output_tokens=50,
                        request_spec_metrics={"per_step_accepted": [1], "per_step_drafted": [3]})
    ok = RequestRecord(id="r1", text=text, output_tokens=reply_ids_len(tokenizer_dir, text),
                       request_spec_metrics={"per_step_accepted": [1], "per_step_drafted": [3]})
    row = acceptance_by_class([_point(tmp_path, tokenizer_dir, [rec, ok])])[0]
    assert (row.replies, row.replies_skipped) == (1, 1)
    # no per-step counts (a baseline, or an endpoint without detailed metrics): no row
    plain = RequestRecord(id="r1", text=text, output_tokens=5, request_spec_metrics={"num_spec_steps": 2})
    assert acceptance_by_class([_point(tmp_path, tokenizer_dir, [plain])]) == []


def reply_ids_len(tokenizer_dir, text):
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tokenizer_dir)(text, add_special_tokens=False).input_ids) + 1
