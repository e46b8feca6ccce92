"""The generic head's built-in prompts: distinct, deterministic, broad, and never about shopping."""

from cartspec.draft.general_prompts import general_prompts

COMMERCE_WORDS = ("shop", "order", "product", "price", "buy", "cart", "store", "brand", "refund", "deliver")


def test_prompts_are_distinct_and_deterministic():
    a = general_prompts(1600, seed=0)
    assert len(a) == len(set(a)) == 1600
    assert general_prompts(1600, seed=0) == a
    assert general_prompts(1600, seed=1) != a


def test_prompts_cover_code_and_structured_output_but_not_shopping():
    p = general_prompts(1600, seed=0)
    assert not [x for x in p if any(w in x.lower() for w in COMMERCE_WORDS)]
    assert sum("JSON" in x for x in p) >= 50
    assert sum("function" in x for x in p) >= 20
