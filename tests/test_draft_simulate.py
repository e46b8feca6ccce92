"""Offline acceptance: token classes, step accounting (τ, per-position,
by-class), alignment of vLLM's per-step counts, the simulator walk, and the
n-gram proposer against vLLM's own implementation."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cartspec.draft.classes import char_classes, token_classes
from cartspec.draft.simulate import (Step, ngram_propose, simulate_ngram, simulate_sequence, steps_from_vllm,
                                     summarize)


def test_char_classes_of_a_search_reply():
    text = '{"intent": "search", "keywords": "denim jacket", "colors": ["red"], "price_max": 29.99, "size": "3xl"}'
    req = "any red denim jacket under 29.99, size 3XL"
    lab, is_json = char_classes(text, req)
    assert is_json

    def cls_of(sub, nth=0):
        i = -1
        for _ in range(nth + 1):
            i = text.index(sub, i + 1)
        return {lab[k] for k in range(i, i + len(sub))}

    assert cls_of("intent") == {"json_key"}
    assert cls_of("search") == {"value_not_in_request"}
    assert cls_of("denim jacket") == {"value_copied"}
    assert cls_of("red") == {"value_copied"}
    assert cls_of("29.99") == {"value_copied"}
    assert cls_of("3xl") == {"value_copied"}  # case-insensitive
    assert cls_of('{"') == {"json_structure"} and cls_of('": ') == {"json_structure"}
    assert cls_of('"]') == {"json_structure"}


def test_free_text_and_non_json():
    text = '{"intent": "support", "topic": "refund_window", "reply": "You can return most items."}'
    lab, _ = char_classes(text, "refund policy?")
    i = text.index("You can")
    assert set(lab[i:i + 7]) == {"free_text"}
    assert set(lab[text.index("refund_window"):][:6]) == {"value_copied"}  # the word 'refund' is in the request
    lab, is_json = char_classes("Sure! Here are some shoes.", "shoes")
    assert not is_json and set(lab) == {"free_text"}


def test_token_classes_align_with_tokens(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok('{"intent": "search", "colors": ["red"]}<|im_end|>', add_special_tokens=False).input_ids
    cl = token_classes(tok, ids, "red shoes")
    assert len(cl) == len(ids)
    pieces = dict(zip([tok.decode([i]) for i in ids], cl))
    assert pieces["red"] == "value_copied"
    assert pieces["colors"] == "json_key"
    assert cl[-1] == "json_structure"  # end of turn of a JSON reply


def test_summarize_counts():
    steps = [[Step(3, 3, ["json_key"] * 3), Step(1, 3, ["json_structure", "value_copied", "json_key"]),
              Step(0, 3, ["free_text", "free_text", "free_text"])]]
    s = summarize(steps, 3)
    assert s["tau"] == pytest.approx(1 + 4 / 3)
    assert s["acceptance_rate"] == pytest.approx(4 / 9)
    assert s["per_position"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    bc = s["by_class"]
    # reached: all drafts up to and including the first rejected one
    assert bc["json_key"] == {"reached": 3, "accepted": 3, "acceptance": 1.0}
    assert bc["json_structure"] == {"reached": 1, "accepted": 1, "acceptance": 1.0}
    assert bc["value_copied"] == {"reached": 1, "accepted": 0, "acceptance": 0.0}
    assert bc["free_text"] == {"reached": 1, "accepted": 0, "acceptance": 0.0}
    assert bc["value_not_in_request"]["acceptance"] is None


def test_acceptance_report_writes_the_measurement_and_loads_back(tmp_path):
    """``draft acceptance --out`` writes an ``AcceptanceReport``: the keys the measurement gave (each mode its
    own), no others, and the same values as the measurement's JSON; it loads back to the same report."""
    import json

    from cartspec.draft.acceptance import AcceptanceReport

    steps = [[Step(3, 3, ["json_key"] * 3), Step(1, 3, ["json_structure", "value_copied", "json_key"])]]
    simulated = {**summarize(steps, 3, {"json_key": 4}), "mode": "simulate", "method": "eagle3", "gamma": 3,
                 "target": "/m", "head": None, "n": 1, "temperature": 0.0, "max_tokens": 64, "output_tokens": 6,
                 "wall_s": 1.5, "engine": {"vllm": "x"}, "data": "dev", "head_name": "domain"}
    served = {**summarize(steps, 3), "engine_counts": {"num_spec_steps": 2, "num_accepted_draft_tokens": 4,
                                                       "num_draft_tokens": 6, "tau": 3.0, "acceptance_rate": 0.6667},
              "replay_agrees_with_engine": "1/1 requests", "replies": [{"id": "r0", "token_ids": [1, 2],
                                                                        "per_step_accepted": [3, 1]}],
              "mode": "vllm", "concurrency": 8, "requests_without_step_metrics": 0, "output_tokens_per_s": 4.0,
              "server": "http://h:8000", "served_name": "m", "server_api_key_env": "KEY"}
    for res in (simulated, served):
        path = AcceptanceReport.model_validate(res).save(tmp_path / f"{res['mode']}.json")
        written = json.loads(path.read_text())
        assert written == json.loads(json.dumps(res))  # the keys and values the dict was written with
        assert AcceptanceReport.load(path) == AcceptanceReport.model_validate(res)
    with pytest.raises(ValueError):
        AcceptanceReport.model_validate({**served, "not_a_field": 1})


def test_steps_from_vllm_alignment():
    classes = [f"c{k}" for k in range(10)]
    st = steps_from_vllm([2, 0, 3], [3, 3, 3], classes)
    # token 0 from prefill; step 1 drafts 1..3 (accepts 2, bonus is 3); step 2 drafts 4..6; step 3 drafts 5..7
    assert [s.classes for s in st] == [["c1", "c2", "c3"], ["c4", "c5", "c6"], ["c5", "c6", "c7"]]


def test_simulate_sequence_walk():
    P, gamma = 5, 3
    tokens = list(range(100, 100 + P + 12))  # 12 output tokens
    L = len(tokens)
    perfect = torch.tensor([[tokens[i + 2 + k] if i + 2 + k < L else -1 for k in range(gamma)]
                            for i in range(P - 1, L - 1)])
    steps = simulate_sequence(perfect, tokens, P, gamma)
    # 11 drafted tokens after the prefill token: 3 full steps (4 tokens each) = 12 > 11 -> 3 steps
    assert [s.accepted for s in steps] == [3, 3, 3]
    wrong = torch.full_like(perfect, -5)
    steps = simulate_sequence(wrong, tokens, P, gamma)
    assert [s.accepted for s in steps] == [0] * 11 and summarize([steps], gamma)["tau"] == 1.0
    # accepted first draft only: each step emits 2 tokens
    half = perfect.clone()
    half[:, 1:] = -5
    steps = simulate_sequence(half, tokens, P, gamma)
    assert [s.accepted for s in steps][:5] == [1] * 5
    # a draft cut per request (draft length per request): a perfect proposal cut to 1 token accepts 1 and
    # counts 1 drafted; cut to nothing, the target's token alone moves it on, and, as vLLM counts, that is
    # no verify step with drafts
    steps = simulate_sequence(perfect, tokens, P, gamma, adjust=lambda i, row: row[:1])
    assert [(s.accepted, s.drafted) for s in steps][:3] == [(1, 1)] * 3
    assert simulate_sequence(perfect, tokens, P, gamma, adjust=lambda i, row: []) == []
    steps = simulate_sequence(perfect, tokens, P, gamma, adjust=lambda i, row: row if i % 2 else [])
    assert all(s.drafted == 3 for s in steps) and len(steps) == 3


def test_ngram_proposer_matches_vllm():
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as vllm_ngram

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(3, 40)
        ctx = [rng.randint(0, 6) for _ in range(n)]
        got = ngram_propose(ctx, 3, 2, 4)
        want = vllm_ngram(np.array(ctx, dtype=np.int32), 2, 4, 10_000, 3).tolist()
        assert got == want, ctx


def test_simulate_ngram_counts():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 4, 7]
    summary, steps = simulate_ngram([(toks, 5)], gamma=3)
    # after [.. 9, 1] nothing matches 2-grams... the first proposal comes once "1 2" repeats
    assert steps[0][0].accepted == 2 and steps[0][0].drafted == 3  # proposes 3 4 9 after "1 2"; 3 4 accepted
    assert summary["tau"] >= 1.0


def test_a_replayed_hybrid_step_records_what_the_head_alone_would_have_had_accepted():
    from cartspec.draft.simulate import simulate_sequence, summarize

    # prompt of 2 tokens, output 10 11 12 13 14; the head is wrong from its second draft on, the hybrid
    # replaces that with the right token
    tokens = [1, 2, 10, 11, 12, 13, 14]
    pred = torch.tensor([[11, 99, 98], [12, 13, 14], [13, 14, 0], [14, 0, 0], [0, 0, 0]])

    def adjust(i, row):
        return [11, 12, 13] if i == 1 else row

    steps = simulate_sequence(pred, tokens, 2, 3, classes=["json_key"] * 5, adjust=adjust)
    assert (steps[0].accepted, steps[0].head_accepted) == (3, 1)
    res = summarize([steps], 3)
    key = res["by_class"]["json_key"]
    assert key["reached"] == 3 and key["accepted"] == 3 and key["head_alone"] == 1
    assert key["head_alone_acceptance"] == pytest.approx(1 / 3)
    # the head alone (no adjust): no paired fields
    assert "head_alone" not in summarize([simulate_sequence(pred, tokens, 2, 3, ["json_key"] * 5)], 3)["by_class"]["json_key"]


def test_an_acceptance_report_keeps_replies_of_requests_without_an_id(tmp_path):
    """A user's prompt file has no ids: its replies are written with ``"id": null`` and load back."""
    from cartspec.draft.acceptance import AcceptanceReport

    rep = AcceptanceReport.model_validate({"tau": 2.0, "replies": [{"id": None, "token_ids": [1, 2],
                                                                     "per_step_accepted": [1]}]})
    out = tmp_path / "acc.json"
    rep.save(out)
    back = AcceptanceReport.load(out)
    assert back.replies[0].id is None and back.replies[0].token_ids == [1, 2]
