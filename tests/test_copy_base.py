"""What the prompt fixes and the head does not judge (``rules.base``): a number value's digits copied from the
shopper's number (``copying.number_lookup``), a word's rest (``copying.word_rest``), on a hand-made
vocabulary where every digit is its own token (as SmolLM2 writes numbers)."""

import numpy as np
import pytest

from cartspec.drafting import HybridConfig, TokenInfo, propose
from cartspec.drafting.copying import number_lookup, splice, word_rest
from cartspec.drafting.rules import base, combine

_TEXTS = ["<s>", "\n", '{"', '":', " ", ",", "}", '"}', "price_max", "min_rating", " under", " US", "$", " and",
          " stars", " rating", "x", "."] + [str(d) for d in range(10)] + [
          "colors", ' ["', '"],', " chart", "chart", "re", "use", " shoes", "Chart", " Chart", "_asc"]
_ID = {t: i for i, t in enumerate(_TEXTS)}


def _ids(*texts):
    return [_ID[t] for t in texts]


def _encode(text):
    ids, i = [], 0
    while i < len(text):
        best = max((t for t in _TEXTS[1:] if text.startswith(t, i)), key=len, default=None)
        ids.append(-1 if best is None else _ID[best])  # -1: a character the vocabulary lacks
        i += 1 if best is None else len(best)
    return ids


INFO = TokenInfo.from_texts(_TEXTS, special=[0], encode=_encode)
PROMPT = _ids("<s>", " under", " US", "$", "2", "5", "0", " and", " ", "4", ".", "2",
              " stars", "\n")  # "<s> under US$250 and 4.2 stars\n"
KEY_PRICE = _ids('{"', "price_max", '":', " ")
KEY_RATING = _ids('{"', "min_rating", '":', " ")


def test_the_rest_of_the_shoppers_number_is_drafted_and_nothing_outside_a_number():
    # "price_max": 2 -> the rest of "250"
    assert number_lookup(PROMPT + KEY_PRICE + _ids("2"), len(PROMPT), 3, INFO) == _ids("5", "0")
    assert number_lookup(PROMPT + KEY_PRICE + _ids("2", "5"), len(PROMPT), 3, INFO) == _ids("0")
    assert number_lookup(PROMPT + KEY_PRICE + _ids("2"), len(PROMPT), 1, INFO) == _ids("5")  # k tokens at most
    # the whole number written: nothing left, the head closes the value
    assert number_lookup(PROMPT + KEY_PRICE + _ids("2", "5", "0"), len(PROMPT), 3, INFO) == []
    # "min_rating": 4 and 4. -> the rest of "4.2"
    assert number_lookup(PROMPT + KEY_RATING + _ids("4"), len(PROMPT), 3, INFO) == _ids(".", "2")
    assert number_lookup(PROMPT + KEY_RATING + _ids("4", "."), len(PROMPT), 3, INFO) == _ids("2")
    # the value has not started (the pointer's or the head's first digit), or is no number of the prompt's
    assert number_lookup(PROMPT + KEY_PRICE, len(PROMPT), 3, INFO) == []
    assert number_lookup(PROMPT + KEY_PRICE + _ids("7"), len(PROMPT), 3, INFO) == []
    # "5" is in the prompt only inside "250" (not a number's start): no copy
    assert number_lookup(PROMPT + KEY_PRICE + _ids("5"), len(PROMPT), 3, INFO) == []
    # digits outside a key's value (in the prompt itself, or not after '": ')
    assert number_lookup(PROMPT[:5], 5, 3, INFO) == []
    assert number_lookup(PROMPT + _ids('{"', "x", "2"), len(PROMPT), 3, INFO) == []


def test_the_latest_number_that_starts_so_is_taken_and_a_turns_end_stops_it():
    prompt = _ids("<s>", " under", " ", "2", "0", "<s>", " under", " ", "2", "9", "9", "\n")
    assert number_lookup(prompt + KEY_PRICE + _ids("2"), len(prompt), 3, INFO) == _ids("9", "9")


def test_a_number_copy_is_the_base_the_gate_does_not_judge():
    ctx = PROMPT + KEY_RATING + _ids("4", ".")
    head = _ids("5", "}", "\n")  # sure of the 4.5 it saw in training
    sure = [0.99, 0.99, 0.99]
    for rule in ("text", "pointer"):
        cfg = HybridConfig(3, 4, rule, "prompt", head_p=0.9)
        assert base(head, ctx, len(PROMPT), cfg, INFO) == _ids("2", "}", "\n")
    cfg = HybridConfig(3, 4, "text", "prompt", head_p=0.9)
    assert propose(head, ctx, len(PROMPT), cfg, INFO, conf=sure) == _ids("2", "}", "\n")
    new, start = combine(head, ctx, len(PROMPT), cfg, INFO)
    assert new == start == _ids("2", "}", "\n")
    # a rule that reads no text leaves the number to the head (and to the n-gram lookup, which rule lookup
    # has: "4 ." matches the prompt's tokens there, and it drafts on past the number, " stars")
    assert base(head, ctx, len(PROMPT), HybridConfig(3, 4, "head", "prompt"), INFO) == head
    assert propose(head, ctx, len(PROMPT), HybridConfig(3, 4, "head", "prompt"), INFO) == head
    assert propose(head, ctx, len(PROMPT), HybridConfig(3, 4, "lookup", "prompt"), INFO) == _ids("2", " stars", "\n")


def test_the_runner_gates_a_copy_against_the_number_base_not_the_heads_digits():
    torch = pytest.importorskip("torch")
    from cartspec.vllm_plugin.hybrid import hybrid_drafts

    class Batch:
        def __init__(self, row, prompt_len):
            self.num_reqs = 1
            self.token_ids_cpu = np.zeros((1, 64), dtype=np.int32)
            self.token_ids_cpu[0, :len(row)] = row
            self.num_tokens_no_spec = np.array([len(row)])
            self.num_prompt_tokens = np.array([prompt_len])
            self.vocab_size = len(_TEXTS)
            self.req_ids = ["r0"]

    class Runner:
        def __init__(self, batch):
            self.input_batch = batch
            self.discard_request_mask = type("M", (), {"np": np.array([False])})()

    row = PROMPT + KEY_RATING  # this step accepted "4" (the bonus token): not in the row yet
    runner = Runner(Batch(row, len(PROMPT)))
    heads = torch.tensor([_ids(".", "5", "}")], dtype=torch.int32)
    sampled = torch.tensor([[_ID["4"], -1, -1, -1]])
    asked = []

    def probs(pairs):
        asked.extend(pairs)
        return {p: 0.99 for p in pairs}

    cfg = HybridConfig(3, 4, "text", "prompt", head_p=0.9)
    out = hybrid_drafts(runner, heads, sampled, cfg, INFO, None, probs)
    assert out.tolist() == [_ids(".", "2", "}")] and asked == []  # nothing else differs: no probability asked
    assert runner._cartspec_copies == {0: 1}  # the copied digit is not the head's (draft_stop cuts only the head's)


WORD_PROMPT = _ids("<s>", " chart", "re", "use", " shoes", "\n")  # "<s> chartreuse shoes"
COLORS = _ids('{"', "colors", '":', ' ["')


def test_the_rest_of_a_prompt_word_the_value_stops_inside_and_nothing_at_a_words_end():
    P = len(WORD_PROMPT)
    assert word_rest(WORD_PROMPT + COLORS + _ids("chart", "re"), P, 3, INFO) == _ids("use")
    assert word_rest(WORD_PROMPT + COLORS + _ids("chart"), P, 3, INFO) == _ids("re", "use")
    assert word_rest(WORD_PROMPT + COLORS + _ids("chart"), P, 1, INFO) == _ids("re")
    assert word_rest(WORD_PROMPT + COLORS + _ids("chart", "re", "use"), P, 3, INFO) == []  # the word is whole
    assert word_rest(WORD_PROMPT + COLORS, P, 3, INFO) == []  # the value has not started
    assert word_rest(WORD_PROMPT + COLORS + _ids("re"), P, 3, INFO) == []  # not at a prompt word's start
    assert word_rest(WORD_PROMPT + _ids('{"', "chart"), P, 3, INFO) == []  # a key, not a value
    # the shopper wrote "Chartreuse": a lower-case value goes on in lower case
    upper = _ids("<s>", " Chart", "re", "use", "\n")
    assert word_rest(upper + COLORS + _ids("chart"), len(upper), 3, INFO) == _ids("re", "use")


def test_a_words_rest_goes_before_the_heads_close_and_the_gate_does_not_judge_it():
    assert splice(_ids('"],', "colors", '":'), _ids("use"), INFO) == _ids("use", '"],', "colors")
    assert splice(_ids("x", "x", "x"), _ids("use"), INFO) == _ids("use", "x", "x")  # no close: over the head
    assert splice(_ids("_asc", "x", "x"), _ids("use"), INFO) == _ids("_asc", "x", "x")  # an identifier goes on
    assert splice(_ids("use", '"],', "x"), _ids("use", "re"), INFO) == _ids("use", "re", '"],')
    ctx = WORD_PROMPT + COLORS + _ids("chart", "re")
    head = _ids('"],', "colors", '":')  # sure of a close inside a word it never saw
    cfg = HybridConfig(3, 4, "text", "prompt", head_p=0.9)
    assert propose(head, ctx, len(WORD_PROMPT), cfg, INFO, conf=[0.99, 0.99, 0.99]) == _ids("use", '"],', "colors")
    assert propose(head, ctx, len(WORD_PROMPT), HybridConfig(3, 4, "head", "prompt"), INFO) == head
    # the head goes on as an identifier (an enum that starts like the shopper's word): its draft is the base
    other = _ids("_asc", '"],', "colors")
    assert base(other, ctx, len(WORD_PROMPT), cfg, INFO) == other


def test_the_heads_close_after_its_own_word_follows_the_rest_of_the_prompts():
    """Where the head drafts another word than the prompt's and closes it later, its close follows the prompt's
    rest whatever the two words' lengths (it drafted from its own word), the head's later tokens filling the
    draft to k; without a close in its draft, the rest is laid over it as before."""
    # the head's one-token word, then its close: the prompt's two-token rest goes before that close
    assert splice(_ids("x", '"],', "colors"), _ids("re", "use"), INFO) == _ids("re", "use", '"],')
    # the head's two-token number then its close, the prompt's number ends after one: the close follows it,
    # and the head's tokens after the close fill the draft
    assert splice(_ids("5", "0", ","), _ids("0"), INFO) == _ids("0", ",", ",")
    assert splice(_ids("5", "0", ",", " "), _ids("0"), INFO) == _ids("0", ",", " ", " ")
    # the close where the rest ends already: laid over, as before
    assert splice(_ids("x", '"],', "colors"), _ids("use"), INFO) == _ids("use", '"],', "colors")
    # no close in the head's draft: laid over
    assert splice(_ids("9", ".", "9"), _ids("0"), INFO) == _ids("0", ".", "9")
    ctx = WORD_PROMPT + COLORS + _ids("chart")
    cfg = HybridConfig(3, 4, "text", "prompt", head_p=0.9)
    assert propose(_ids("x", '"],', "colors"), ctx, len(WORD_PROMPT), cfg, INFO,
                   conf=[0.99, 0.99, 0.99]) == _ids("re", "use", '"],')


class _Pointer:
    def __init__(self, no):
        self.no = no
        self.cfg = type("Cfg", (), {"veto_p": 0.5, "min_p": 0.7})()

    def pick(self, *a, **kw):
        return []

    def no_copy(self, *a, **kw):
        return self.no


def test_a_value_the_pointer_says_copies_nothing_keeps_the_heads_draft():
    ctx = WORD_PROMPT + COLORS + _ids("chart", "re")
    head = _ids('"],', "colors", '":')
    cfg = HybridConfig(3, 4, "pointer", "prompt", head_p=0.0)
    assert base(head, ctx, len(WORD_PROMPT), cfg, INFO, _Pointer(0.9)) == head
    assert propose(head, ctx, len(WORD_PROMPT), cfg, INFO, _Pointer(0.9)) == head
    assert base(head, ctx, len(WORD_PROMPT), cfg, INFO, _Pointer(0.1)) == _ids("use", '"],', "colors")
    assert propose(head, ctx, len(WORD_PROMPT), cfg, INFO, _Pointer(0.1)) == _ids("use", '"],', "colors")


# --- a number value's first digit: the pointer's pick among the prompt's numbers -----------------------------

class NumberPointer:
    """Picks ``number`` at a number value's start (``numbers=True``) and nothing at a string's; records what
    it was asked. ``numbers``: whether it was trained with number values."""

    def __init__(self, number=(), numbers=True):
        self._number, self.numbers = list(number), numbers
        self.cfg = type("Cfg", (), {"veto_p": 0.5, "min_p": 0.7})()
        self.asked = []

    def pick(self, context, prompt_len, k, texts, encode, special, numbers=False, prompt=None):
        self.asked.append((list(context), numbers))
        return self._number[:k] if numbers and self.numbers else []

    def no_copy(self, context, prompt_len, texts, encode, special, prompt=None):
        return 0.0


def test_a_number_value_starts_after_a_keys_colon_in_the_reply_only():
    from cartspec.drafting.tokens import number_open

    P = len(PROMPT)
    assert number_open(PROMPT + KEY_PRICE, P, INFO)  # '"price_max": '
    assert number_open(PROMPT + KEY_PRICE[:-1], P, INFO)  # '"price_max":' (a model that writes no space)
    assert not number_open(PROMPT + KEY_PRICE + _ids("2"), P, INFO)  # the number has begun
    assert not number_open(PROMPT + COLORS, P, INFO)  # a string array opened
    assert not number_open(PROMPT, P, INFO) and not number_open(PROMPT[:-1], P - 1, INFO)  # the prompt
    assert not number_open(PROMPT + _ids('{"', "price_max"), P, INFO)  # a key
    # free text's colon is no key's: "Order: " in a support answer
    free = TokenInfo.from_texts(["<s>", "Order", ":", " ", "7"], special=[0])
    assert not number_open([0, 1, 2, 3], 1, free) and not number_open([0, 1, 2], 1, free)


def test_the_pointers_number_replaces_the_heads_digits_and_the_heads_close_follows():
    P = len(PROMPT)
    cfg = HybridConfig(3, 4, "pointer", "prompt")
    ctx = PROMPT + KEY_PRICE
    # the head's 1, 0 and close, where the shopper wrote 250: the pointer's 2, 5, 0
    ptr = NumberPointer(_ids("2", "5", "0"))
    assert propose(_ids("1", "0", "}"), ctx, P, cfg, INFO, ptr) == _ids("2", "5", "0")
    assert ptr.asked == [(ctx, True)]
    # a shorter number: the head's close after it
    assert propose(_ids("1", "0", "0"), ctx, P, cfg, INFO, NumberPointer(_ids("7", "5"))) == _ids("7", "5", "0")
    assert propose(_ids("1", "0", "}"), ctx, P, cfg, INFO, NumberPointer(_ids("7")))[:2] == _ids("7", "}")
    assert propose(_ids("4", ".", "5"), PROMPT + KEY_RATING, P, cfg, INFO,
                   NumberPointer(_ids("4", ".", "2"))) == _ids("4", ".", "2")
    # drafted after the key: the pick from the draft's number start on
    assert propose(_ids('":', " ", "1"), PROMPT + _ids('{"', "price_max"), P, cfg, INFO,
                   NumberPointer(_ids("2", "5", "0"))) == _ids('":', " ", "2")
    # "no copy": the head's draft; a head that does not draft a digit there is not a number: nobody asked
    assert propose(_ids("1", "0", "}"), ctx, P, cfg, INFO, NumberPointer()) == _ids("1", "0", "}")
    ptr = NumberPointer(_ids("2", "5", "0"))
    assert propose(_ids(' ["', "chart", '"],'), PROMPT + _ids('{"', "colors", '":'), P, cfg, INFO, ptr) == \
        _ids(' ["', "chart", '"],')
    assert all(not numbers for _, numbers in ptr.asked)
    # a pointer trained without number values is not asked for one
    old = NumberPointer(_ids("2", "5", "0"), numbers=False)
    assert propose(_ids("1", "0", "}"), ctx, P, cfg, INFO, old) == _ids("1", "0", "}") and old.asked == []


def _number_requests(n, seed):
    """Prompts with a price and a rating in either order ("<s> under US$250 and 4.2 stars" or "<s> 4.2 stars
    and under US$250"), each followed by a reply whose price_max is the price."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        price = [str(rng.randint(1, 9))] + [str(rng.randint(0, 9)) for _ in range(rng.randint(0, 2))]
        rating = [str(rng.randint(1, 4)), ".", str(rng.randint(0, 9))]
        a = _ids(" under", " US", "$", *price)
        b = _ids(" ", *rating, " stars")
        prompt = _ids("<s>") + (a + _ids(" and") + b if rng.random() < 0.5 else b + _ids(" and") + a) + _ids("\n")
        out.append((prompt + KEY_PRICE + _ids(*price, "}"), len(prompt)))
    return out


def test_a_pointer_trained_with_number_values_picks_the_shoppers_number_and_round_trips(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from cartspec.draft.pointer import examples, train_pointer
    from cartspec.drafting import SPECIAL_TEXT
    from cartspec.drafting.pointer import Pointer, PointerConfig, PointerNet, save

    model = tmp_path / "model"
    model.mkdir()
    torch.manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(len(_TEXTS), 16)}, str(model / "model.safetensors"))
    train, dev = _number_requests(300, 0), _number_requests(40, 1)
    ex = examples(train[:1], INFO)
    assert [e.number for e in ex] == [True]  # one value, a number: its candidates are the prompt's numbers
    toks, P = train[0]
    assert len(ex[0].tokens) == 3 and ex[0].positive != [0]  # the price, and 4.2 read as "4.2" and "2"
    log = train_pointer(model, train, INFO, tmp_path / "ptr", epochs=15, dev=dev, log=lambda m: None)
    assert log["numbers"]["examples"] == 300 and log["numbers"]["copied"] == 300
    assert log["numbers"]["epochs"][-1]["dev_number_copied_top1"] >= 0.9, log["numbers"]["epochs"]
    ptr = Pointer.load(tmp_path / "ptr", model)
    assert ptr.numbers
    for toks, P in dev[:10]:
        ctx = toks[:P + len(KEY_PRICE)]
        price = toks[P + len(KEY_PRICE):-1]
        assert ptr.pick(ctx, P, 3, INFO.texts, INFO.encode, SPECIAL_TEXT, numbers=True) == price
        c, p = ptr.probs(ctx, P, INFO.texts, INFO.encode, SPECIAL_TEXT, numbers=True)
        assert all(p[1 + n] == 0 for n, s in enumerate(c.starts) if not c.text[s].isdigit())  # numbers only
    # a pointer saved without a number net (one trained before number values) picks no number
    cfg = PointerConfig(dim=8, hidden=8, embed_dim=16)
    save(PointerNet(cfg), cfg, tmp_path / "old")
    old = Pointer.load(tmp_path / "old", model)
    assert not old.numbers
    assert old.pick(ctx, P, 3, INFO.texts, INFO.encode, SPECIAL_TEXT, numbers=True) == []
    with pytest.raises(ValueError, match="cartspec draft pointer"):
        old.probs(ctx, P, INFO.texts, INFO.encode, SPECIAL_TEXT, numbers=True)
