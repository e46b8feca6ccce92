"""The generator is the ground truth of every accuracy figure: it must be
deterministic, cover every field and phrasing family, and keep test unseen."""

import json
from collections import Counter

import pytest

from cartspec.task import generator as g
from cartspec.task.data import Request
from cartspec.task.schema import SCHEMAS, SearchParams, SupportReply, canonical_dict


@pytest.fixture(scope="module")
def train():
    return g.generate("train", 3000)


@pytest.fixture(scope="module")
def test_split():
    return g.generate("test", 1500)


def test_same_seed_same_requests():
    a = [r.model_dump() for r in g.generate("dev", 200)]
    b = [r.model_dump() for r in g.generate("dev", 200)]
    assert a == b
    c = [r.model_dump() for r in g.generate("dev", 200, seed=7)]
    assert a != c


def test_splits_differ_and_ids_unique(train, test_split):
    assert len({r.id for r in train}) == len(train)
    train_q = {(r.query, tuple(t.content for t in r.history)) for r in train}
    overlap = sum((r.query, tuple(t.content for t in r.history)) in train_q for r in test_split)
    # Support one-liners like "return window?" may recur; search queries must not.
    assert overlap / len(test_split) < 0.05


def test_gold_validates_and_is_canonical(train):
    for r in train:
        model = SCHEMAS[r.task].model_validate(r.gold)
        assert canonical_dict(model) == r.gold


def test_every_search_field_is_exercised(train):
    set_fields = Counter(k for r in train if r.task == "search" for k in r.gold)
    for name in SearchParams.model_fields:
        assert set_fields[name] >= 20, f"field {name} appears only {set_fields[name]} times"
    intents = Counter(r.gold["intent"] for r in train)
    assert {"search", "refine", "compare", "support"} <= set(intents)
    topics = Counter(r.gold["topic"] for r in train if r.task == "support")
    assert set(topics) == {t.value for t in SupportReply.model_fields["topic"].annotation}


def test_phrasing_families_covered(train, test_split):
    fams_train = Counter(f for r in train for f in r.meta["families"])
    families = {f.split(":")[0] for f in fams_train}
    for fam in ("typo", "color", "negation", "size", "price_max", "price_min", "price_range", "rating",
                "sort", "delivery", "in_stock", "audience", "material", "compare", "amount",
                "currency_USD", "currency_EUR", "currency_GBP", "currency_JPY", "currency_CAD",
                "refine_cheaper", "refine_color_swap", "refine_drop_brand", "refine_exclude", "refine_price"):
        assert fam in families, fam
    assert fams_train["color:abbrev"] > 0 and fams_train["size:word"] > 0 and fams_train["amount:k"] > 0
    # Train never uses a held-out phrasing; test uses plenty.
    assert not any(f.endswith(":held") for f in fams_train)
    held = sum(any(f.endswith(":held") for f in r.meta["families"]) for r in test_split)
    assert held / len(test_split) > 0.5


def test_test_split_uses_values_never_seen_in_training(train, test_split):
    def values(reqs):
        out = set()
        for r in reqs:
            for k in ("keywords", "material", "size"):
                if r.gold.get(k):
                    out.add((k, r.gold[k]))
            for k in ("brands_include", "brands_exclude", "colors"):
                out.update((k, v) for v in r.gold.get(k, []))
        return out

    unseen = values(test_split) - values(train)
    kinds = {k for k, _ in unseen}
    assert {"keywords", "brands_include", "colors", "material", "size"} <= kinds
    frac = sum(bool(values([r]) - values(train)) for r in test_split) / len(test_split)
    assert frac > 0.3


def test_slang_and_units_resolve_to_canonical_values():
    reqs = g.generate("train", 3000)
    by_fam = {}
    for r in reqs:
        for f in r.meta["families"]:
            by_fam.setdefault(f, r)
    r = by_fam["color:abbrev"]
    assert any(v in g.COLOR_ABBREV for v in r.gold["colors"])
    r = by_fam["amount:k"]
    assert max(r.gold.get("price_max", 0), r.gold.get("price_min", 0)) >= 1000
    r = next(r for r in reqs if "bucks" in r.query and "price_max" in r.gold)
    assert r.gold["currency"] == "USD"


def test_refinement_gold_merges_history():
    reqs = [r for r in g.generate("train", 2000) if r.meta["kind"] == "refine"]
    assert reqs
    for r in reqs:
        prev = json.loads(r.history[-1].content)
        assert r.gold["intent"] == "refine"
        assert r.gold["keywords"] == prev["keywords"] and r.gold["category"] == prev["category"]
    drop = [r for r in reqs if r.meta["last_step"] == "refine_drop_brand"]
    assert drop and all("brands_include" not in r.gold for r in drop)
    assert all(json.loads(r.history[-1].content).get("brands_include") for r in drop)


def test_requests_roundtrip_jsonl(tmp_path):
    from cartspec.task.data import read_requests, write_requests

    reqs = g.generate("dev", 50)
    path = write_requests(tmp_path / "dev.jsonl", reqs)
    back = read_requests(path)
    assert [r.model_dump() for r in back] == [r.model_dump() for r in reqs]
    assert isinstance(back[0], Request)


def _seen_held_pairs():
    """Every (name, seen, held) split the generator draws from."""
    for name, v in vars(g).items():
        if isinstance(v, g.Pool):
            yield name, v.seen, v.held
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(x, g.Pool):
                    yield f"{name}.{k}", x.seen, x.held
                elif isinstance(x, tuple) and len(x) == 2 and all(isinstance(t, tuple) for t in x):
                    yield f"{name}.{k}", x[0], x[1]


def test_held_out_words_never_appear_in_any_seen_list():
    pairs = list(_seen_held_pairs())
    assert len(pairs) > 50  # products, brands, materials, sizes, currencies, every phrasing family
    for name, seen, held in pairs:
        assert not set(seen) & set(held), name
    # nor under another category: a held product or brand is held everywhere
    for table in (g.PRODUCTS, g.BRANDS, g.MATERIALS):
        seen = {x for pool in table.values() for x in pool.seen}
        held = {x for pool in table.values() for x in pool.held}
        assert not seen & held


def test_training_balances_price_direction_test_keeps_the_natural_mix(train, test_split):
    def mix(reqs):
        c = Counter(("min" if "price_min" in r.gold else "") + ("max" if "price_max" in r.gold else "")
                    for r in reqs if r.meta["kind"] == "search" and "currency" in r.gold)
        first_min = c["min"] + c["minmax"]  # a range is written price_min first
        return first_min / sum(c.values()), c["max"] / sum(c.values())
    train_min, train_max = mix(train)
    assert 0.43 < train_min < 0.57 and 0.43 < train_max < 0.57  # the first price key: _min half the time
    test_min, test_max = mix(test_split)
    assert test_min < 0.47 and test_max > 0.53  # the natural mix: 40% / 60%


def test_each_request_says_what_training_never_showed_it(train, test_split):
    assert {r.meta["unseen"] for r in train} == {"none"}
    kinds = Counter(r.meta["unseen"] for r in test_split)
    assert set(kinds) == {"none", "values", "phrasings", "both"}
    assert kinds["both"] > kinds["none"]
    assert g.unseen(["color:plain", "size:held"], {"keywords": "jeans"}) == "phrasings"
    assert g.unseen(["color:plain"], {"colors": ["teal"], "keywords": "jeans"}) == "values"


def test_dev_and_test_splits_are_the_yardstick_and_do_not_drift():
    """Training-only data changes must not move dev or test: every accuracy
    figure in the README and the notes is on these exact requests. If you change them on purpose,
    re-measure every model and update this digest."""
    import hashlib
    digest = {s: hashlib.sha256(json.dumps([r.model_dump() for r in g.generate(s, n)], sort_keys=True)
                                .encode()).hexdigest()[:16] for s, n in (("dev", 200), ("test", 400))}
    assert digest == EXPECTED_SPLIT_DIGESTS


EXPECTED_SPLIT_DIGESTS = {"dev": "843567bb3bfda692", "test": "0070df0fa69400d4"}  # session 3 generator
