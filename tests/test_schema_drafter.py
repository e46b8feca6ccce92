"""The schema drafter: drafts from a reply's JSON schema and the prompt, with no head (``drafting.schema``)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from cartspec.draft.simulate import simulate_ngram, simulate_proposer
from cartspec.drafting.schema import SchemaGrammar, Vocabulary
from cartspec.serving.spec import DeploymentSpec, Speculative
from cartspec.task.generator import generate
from cartspec.task.schema import json_schema, reply_schema, union


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def grammar(tok):
    return SchemaGrammar(tok, reply_schema())


def gold_sequences(tok, n=24, split="test"):
    """(prompt + gold reply + end of turn, prompt length): the replies a model trained on the task writes."""
    from cartspec.draft.pointer import sequences_from_gold

    return sequences_from_gold(tok, generate(split, n, 0))


def dec(tok, ids):
    return [tok.decode([t]) for t in ids]


def test_what_the_grammar_forces_is_drafted(tok, grammar):
    prompt = tok("show me red shoes", add_special_tokens=False).input_ids
    tr = grammar.track(prompt)
    tr.feed(tok('{"int', add_special_tokens=False).input_ids)
    assert "".join(dec(tok, tr.draft(3))).startswith('ent":')  # the rest of the one key "int" begins
    tr = grammar.track(prompt)
    tr.feed(tok('{"intent": "support", "topic": "ref', add_special_tokens=False).input_ids)
    assert "".join(dec(tok, tr.draft(5))).startswith("und_window")  # the one enum value "ref" begins


def test_an_enum_value_the_prompt_names_and_a_number_it_holds_are_drafted(tok, grammar):
    prompt = tok("wireless headphones under 80 dollars with free shipping", add_special_tokens=False).input_ids
    tr = grammar.track(prompt)
    tr.feed(tok('{"intent": "search", "keywords": "wireless headphones", "price_max": ', add_special_tokens=False).input_ids)
    assert "".join(dec(tok, tr.draft(2))).startswith("80")
    tr = grammar.track(prompt)
    tr.feed(tok('{"intent": "search", "delivery": ', add_special_tokens=False).input_ids)
    assert "free_shipping" in "".join(dec(tok, tr.draft(6)))


def test_drafts_are_k_tokens_at_most_and_the_grammar_accepts_them(tok, grammar):
    for seq, P in gold_sequences(tok, 12):
        tr = grammar.track(seq[:P])
        for j in range(P, len(seq) - 1):
            tr.feed(seq[P:j + 1])
            for k in (1, 3, 5):
                d = tr.draft(k)
                assert len(d) <= k
                m = tr.matcher.fork()
                assert all(m.accept_token(t) for t in d), dec(tok, d)


def test_a_compact_reply_is_followed_in_its_own_format(tok, grammar):
    """vLLM's structured outputs without whitespace write ``{"a":"b","c":1}``: the track replays the reply on
    the compact format and drafts in it."""
    tr = grammar.track(tok("refund window?", add_special_tokens=False).input_ids)
    tr.feed(tok('{"intent":"support","top', add_special_tokens=False).input_ids)
    assert tr.alive and tr.format == 1
    assert "".join(dec(tok, tr.draft(4))).startswith('ic":"')


def test_a_reply_that_leaves_the_grammar_gets_no_drafts(tok, grammar):
    tr = grammar.track(tok("what is your refund window?", add_special_tokens=False).input_ids)
    tr.feed(tok("You can return items within 30 days.", add_special_tokens=False).input_ids)
    assert not tr.alive and tr.draft(3) == []


def test_on_the_tasks_replies_it_drafts_well_above_ngram(tok, grammar):
    """The gold replies stand in for the fine-tuned model's (it was trained to write them): JSON structure and
    keys are mostly forced or follow the schema's order, so the schema drafter's τ at γ=3 is well above
    n-gram lookup's on the same replies."""
    seqs = gold_sequences(tok, 32)
    schema, _ = simulate_proposer(seqs, 3, grammar.track)
    ngram, _ = simulate_ngram(seqs, 3, 2, 4)
    assert schema["tau"] > 2.5 and schema["tau"] > ngram["tau"] + 0.4, (schema["tau"], ngram["tau"])


def test_union_moves_defs_to_the_top_and_keeps_property_order():
    u = union(json_schema("search"), json_schema("support"))
    assert set(u) == {"anyOf", "$defs"} and "Category" in u["$defs"] and "SupportTopic" in u["$defs"]
    assert all("$defs" not in part for part in u["anyOf"])
    v = Vocabulary.of(u)
    assert v.keys[:3] == ("intent", "keywords", "category")  # the schema's order, not sorted
    assert "free_shipping" in v.enums["delivery"] and "support" in v.enums["intent"]
    with pytest.raises(ValueError, match=r"\$defs/X"):
        union({"$defs": {"X": {"type": "string"}}}, {"$defs": {"X": {"type": "integer"}}})


def test_the_schema_deployment_uses_vllms_custom_class_and_carries_its_schema(tmp_path):
    from cartspec.serving.server import VllmServer

    sp = Speculative(method="schema", num_speculative_tokens=3)
    assert sp.label == "schema-g3"
    assert sp.vllm_config() == {"num_speculative_tokens": 3, "method": "custom_class",
                                "model": "cartspec.vllm_plugin.schema.SchemaProposer"}
    assert "reply_schema" not in sp.model_dump()  # absent settings leave spec files (and study keys) as they were
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}))
    spec = DeploymentSpec(name="x", model=str(tmp_path),
                          speculative=Speculative(method="schema", num_speculative_tokens=3, reply_schema=str(f)))
    cmd = VllmServer(spec, model_dir=tmp_path, log_dir=tmp_path).command()
    extra = json.loads(cmd[cmd.index("--additional-config") + 1])
    # the schema as written: its property order is the order replies write keys in
    assert list(extra["cartspec_schema"]["schema"]["properties"]) == ["b", "a"]
    assert Speculative.model_validate(sp.model_dump()) == sp


def test_bad_schema_settings_are_refused_with_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="no head"):
        Speculative(method="schema", num_speculative_tokens=3, model="domain")
    with pytest.raises(ValueError, match="setting of method 'schema'"):
        Speculative(method="ngram", num_speculative_tokens=3, reply_schema="x.json")
    with pytest.raises(ValueError, match="does not exist"):
        Speculative(method="schema", num_speculative_tokens=3, reply_schema=str(tmp_path / "none.json")).schema_dict()
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        Speculative(method="schema", num_speculative_tokens=3, reply_schema=str(tmp_path / "bad.json")).schema_dict()


class _Batch:
    def __init__(self, req_ids, prompt_lens):
        self.req_ids = req_ids
        self.num_prompt_tokens = prompt_lens


def test_the_proposer_drafts_per_request_from_the_runners_batch(tok, tokenizer_dir):
    """``SchemaProposer`` as vLLM calls it (token rows only), with the batch patch ``schema_batch`` binds:
    each request keeps its grammar state between steps, a request that sent its own schema is drafted from
    it, and a proposer left unbound says which patch is missing."""
    import numpy as np
    from types import SimpleNamespace

    from cartspec.vllm_plugin.schema import KEY, SchemaProposer

    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3),
                          additional_config={KEY: {"schema": reply_schema()}},
                          model_config=SimpleNamespace(tokenizer=str(tokenizer_dir), model=str(tokenizer_dir)))
    prop = SchemaProposer(cfg)
    with pytest.raises(RuntimeError, match="schema_batch"):
        prop.propose([[1]], np.array([1]), np.zeros((1, 8), dtype=np.int64))
    own = SimpleNamespace(sampling_params=SimpleNamespace(structured_outputs=SimpleNamespace(
        json={"type": "object", "properties": {"zeta": {"type": "string"}}, "required": ["zeta"]})))
    runner = SimpleNamespace(input_batch=_Batch(["a", "b"], [2, 2]), requests={"b": own})
    prop.bind(runner)
    rows = np.zeros((2, 64), dtype=np.int64)
    prompt = tok("hi!", add_special_tokens=False).input_ids[:2]
    reply = tok('{"', add_special_tokens=False).input_ids
    for i in range(2):
        rows[i, :2] = prompt
        rows[i, 2:2 + len(reply)] = reply
    n = np.array([2 + len(reply)] * 2)
    out = prop.propose([[reply[-1]], [reply[-1]]], n, rows)
    assert "".join(dec(tok, out[1])).startswith("zeta")  # b's own schema has one key
    assert not "".join(dec(tok, out[0])).startswith("zeta")  # a follows the deployment's
    assert prop.propose([[], [reply[-1]]], n, rows)[0] == []  # no token this step: no draft


def test_with_a_head_the_heads_draft_stands_where_the_grammar_accepts_it(tok, grammar):
    """Hybrid rule ``schema``: the head's tokens stand while the grammar accepts them; from one it refuses,
    the schema drafter drafts; inside a short string value a copy from the prompt replaces the head's."""
    from cartspec.drafting import HybridConfig, propose

    prompt = tok("show me wireless headphones", add_special_tokens=False).input_ids
    reply = tok('{"intent": "search", "keywords": "wire', add_special_tokens=False).input_ids
    cfg = HybridConfig(rule="schema")
    # a value the head continues wrong: the prompt's word it begins replaces the head's tokens
    wrong = tok("d cats dogs", add_special_tokens=False).input_ids[:3]
    d = propose(wrong, prompt + reply, len(prompt), cfg, schema=grammar)
    assert len(d) == 3 and tok.decode(d).startswith("less"), tok.decode(d)
    # structure the head gets right stands as it is
    tr = grammar.track(prompt)
    done = tok('{"intent": "search", "keywords": "wireless headphones"', add_special_tokens=False).input_ids
    tr.feed(done)
    good = tok(', "category', add_special_tokens=False).input_ids[:3]
    assert tr.combine(good) == good
    # a token the grammar refuses (a key the schema lacks) is replaced by the schema drafter's draft
    bad = tok(', "colour', add_special_tokens=False).input_ids[:3]
    fixed = tr.combine(bad)
    assert fixed != bad and tok.decode(fixed).startswith(', "')
    m = tr.matcher.fork()
    assert all(m.accept_token(t) for t in fixed)
    with pytest.raises(ValueError, match="compiled schema"):
        propose(good, prompt + done, len(prompt), cfg)  # rule schema without the schema


def test_rule_pointer_schema_takes_the_pointers_pick_and_the_grammars_check(tok, grammar):
    """Hybrid rule ``pointer-schema``: at a value's opening quote the pointer's pick replaces the head's
    draft (which the head drafts worst); the schema drafter then checks the draft against the grammar and
    drafts from a token it refuses."""
    from test_pointer import FakePointer

    from cartspec.drafting import HybridConfig, TokenInfo, propose

    info = TokenInfo.from_tokenizer(tok)
    cfg = HybridConfig(rule="pointer-schema", head_p=0)
    prompt = tok("show me wireless headphones", add_special_tokens=False).input_ids
    reply = tok('{"intent": "search", "keywords": "', add_special_tokens=False).input_ids
    wireless = tok("wireless", add_special_tokens=False).input_ids
    wrong = tok("cats dogs birds", add_special_tokens=False).input_ids[:3]
    d = propose(wrong, prompt + reply, len(prompt), cfg, info, FakePointer(wireless), schema=grammar)
    assert tok.decode(d).startswith("wireless"), tok.decode(d)
    assert propose(wrong, prompt + reply, len(prompt), HybridConfig(rule="pointer", head_p=0), info,
                   FakePointer(wireless))[:len(wireless)] == wireless  # the pointer's pick, as rule pointer
    # after a value, a key the schema lacks: the grammar refuses it and the schema drafter drafts
    done = tok('{"intent": "search", "keywords": "wireless headphones"', add_special_tokens=False).input_ids
    bad = tok(', "colour', add_special_tokens=False).input_ids[:3]
    fixed = propose(bad, prompt + done, len(prompt), cfg, info, FakePointer(), schema=grammar)
    assert fixed != bad and tok.decode(fixed).startswith(', "')
    with pytest.raises(ValueError, match="compiled schema"):
        propose(bad, prompt + done, len(prompt), cfg, info, FakePointer())


def test_the_drafters_shortcuts_give_what_the_long_ways_give(tok, grammar):
    """The per-step work is cut three ways; each must change nothing: a name found without a regex, a string
    tried on the matcher itself and rolled back (no fork), token ids from the tokenizer's backend, kept."""
    import random
    import re

    from cartspec.drafting.schema import _accepts, _named
    from cartspec.drafting.tokens import encoder

    def by_regex(value, text):
        words = value.replace("_", " ").lower().strip()
        return bool(words) and re.search(r"(?<![a-z0-9])" + re.escape(words) + r"(?![a-z0-9])", text) is not None

    rng = random.Random(0)
    alphabet = "ab 1_-é."
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        value = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))
        assert _named(value, text) == by_regex(value, text), (value, text)
    m = grammar.track([]).matcher
    assert m.accept_string('{"intent": "search", "keywords": "red"')
    for probe in (', "category": "shoes"', "@@", ', "category": 5', "Qz\u00e9", '}', ""):
        before = m.find_jump_forward_string()
        want = m.fork().accept_string(probe) if probe else True
        assert _accepts(m, probe) == want
        assert m.find_jump_forward_string() == before and m.fork().accept_string(', "category": "shoes"')
    encode = encoder(tok)
    for text in ('", "', '{"intent": "search"', " red  shoes ", "Gr\u00fc\u00dfe \u2014 caf\u00e9", "", '"]}'):
        assert encode(text) == tok.encode(text, add_special_tokens=False) == encode(text)
