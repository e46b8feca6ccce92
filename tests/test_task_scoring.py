"""Parser and scorer edge cases: what a replies' figure means depends on them."""

import pytest

from cartspec.task.data import DataFileError, Request, read_requests
from cartspec.task.parse import coerce, parse_reply, read_reply
from cartspec.task.score import aggregate, score_item

GOLD = {"intent": "search", "keywords": "running shoes", "category": "shoes", "colors": ["red"],
        "price_max": 120, "currency": "USD"}
REQ = Request(query="red running shoes under $120", gold=GOLD)
EXACT = '{"intent": "search", "keywords": "running shoes", "category": "shoes", "colors": ["red"], "price_max": 120, "currency": "USD"}'


def test_exact_reply_scores_perfectly():
    s = score_item(REQ, EXACT)
    assert s.json_valid and s.schema_valid and s.exact
    assert all(s.fields.values())


def test_key_order_list_order_and_case_do_not_matter():
    reply = '{"currency": "USD", "colors": ["RED"], "price_max": 120.0, "category": "shoes", "keywords": "Running Shoes", "intent": "search"}'
    assert score_item(REQ, reply).exact


def test_stray_text_and_code_fence_are_parsed_but_not_json_valid():
    for reply in ("Sure! Here you go:\n" + EXACT + "\nHope this helps", "```json\n" + EXACT + "\n```"):
        s = score_item(REQ, reply)
        assert not s.json_valid and not s.schema_valid
        assert s.exact  # the service can still use it


def test_truncated_json_is_repaired_for_fields():
    p = parse_reply('{"intent": "search", "keywords": "running shoes", "category": "shoes", "colors": ["re')
    assert p.repaired and not p.json_valid
    assert p.data["keywords"] == "running shoes" and p.data["category"] == "shoes"
    s = score_item(REQ, '{"intent": "search", "keywords": "running shoes", "category": "shoes", "colors": ["re')
    assert not s.exact and s.fields["keywords"] and not s.fields["price_max"]


def test_wrong_types_are_coerced_but_not_schema_valid():
    reply = '{"intent": "search", "keywords": "running shoes", "category": "shoes", "colors": "red", "price_max": "$120", "currency": "usd"}'
    s = score_item(REQ, reply)
    assert s.json_valid and not s.schema_valid
    assert s.fields["colors"] and s.fields["price_max"]
    value = coerce("search", {"in_stock": "yes", "price_max": "1.2k", "bogus": 1, "category": "spaceships"})
    assert value.in_stock is True and value.price_max == 1200 and value.category is None


def test_invented_and_missing_fields_count_against():
    s = score_item(REQ, '{"intent": "search", "keywords": "running shoes", "category": "shoes", "colors": ["red"], "price_max": 120, "currency": "USD", "brands_include": ["nike"]}')
    assert not s.exact and s.fields == {**{k: True for k in GOLD}, "brands_include": False}
    s2 = score_item(REQ, '{"intent": "search"}')
    assert sum(s2.fields.values()) == 1 and len(s2.fields) == len(GOLD)


def test_garbage_reply():
    s = score_item(REQ, "I cannot help with that.")
    assert not s.json_valid and not s.schema_valid and not s.exact and s.pred is None
    assert s.error == "no JSON object in reply"
    agg = aggregate([s, score_item(REQ, EXACT)])
    assert agg["json_valid"] == 0.5 and agg["exact_match"] == 0.5
    assert agg["field_accuracy"] == pytest.approx(len(GOLD) / (2 * len(GOLD)))


def test_without_gold_only_validity_is_scored():
    s = score_item(Request(query="red shoes"), EXACT)
    assert s.exact is None and s.fields == {}
    agg = aggregate([s])
    assert agg["json_valid"] == 1.0 and "exact_match" not in agg


def test_support_reply_scoring():
    gold = {"intent": "support", "topic": "order_status", "order_id": "123", "reply": "Order 123 is on its way."}
    req = Request(query="where is 123", task="support", gold=gold)
    ok = '{"intent": "support", "topic": "order_status", "order_id": "123", "reply": "Order 123 is on its way."}'
    assert score_item(req, ok).exact
    bad = '{"intent": "support", "topic": "warranty", "reply": "Order 123 is on its way."}'
    s = score_item(req, bad)
    assert not s.exact and not s.fields["topic"] and not s.fields["order_id"] and s.fields["reply"]
    assert read_reply("support", '{"topic": "order_status"}').value is None  # reply is required


def test_request_file_errors_name_line_and_field(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"query": "ok"}\n{"query": ""}\n')
    with pytest.raises(DataFileError, match=r"r.jsonl:2: query"):
        read_requests(p)
    p.write_text('{"query": "x", "history": [{"role": "robot", "content": "hi"}]}\n')
    with pytest.raises(DataFileError, match="history"):
        read_requests(p)
    with pytest.raises(DataFileError, match="not found"):
        read_requests(tmp_path / "missing.jsonl")


def test_scores_are_broken_down_by_what_training_never_showed():
    from cartspec.task.generator import generate
    from cartspec.task.schema import SCHEMAS, canonical_json

    reqs = generate("test", 60)
    # right on everything but requests holding an unseen value
    replies = ["{}" if r.meta["unseen"] in ("values", "both") else canonical_json(SCHEMAS[r.task].model_validate(r.gold))
               for r in reqs]
    agg = aggregate([score_item(r, t) for r, t in zip(reqs, replies)], reqs)
    by = agg["by_unseen"]
    assert by["phrasings"]["exact_match"] == 1.0 and by["both"]["exact_match"] == 0.0
    assert sum(v["n"] for v in by.values()) == 60


def test_each_reply_row_says_what_was_wrong_with_gold_and_got():
    from cartspec.quality.structured import score_replies

    class Reply:
        text = '{"intent": "search", "keywords": "shoes", "category": "shoes", "colors": ["red"], "price_min": 120, "currency": "USD"}'

    req = Request(id="r1", query=REQ.query, gold=GOLD, meta={"unseen": "phrasings"})
    summary, rows = score_replies([req], [Reply()])
    assert summary["exact_match"] == 0.0
    assert rows[0]["wrong"] == {"keywords": {"gold": "running shoes", "got": "shoes"},
                                "price_max": {"gold": 120, "got": None},
                                "price_min": {"gold": None, "got": 120}}
    assert rows[0]["wrong_fields"] == sorted(rows[0]["wrong"]) and rows[0]["unseen"] == "phrasings"
    assert score_item(REQ, EXACT).wrong() == {}
