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


class _Pointer:
    def __init__(self, no):
        self.no = no
        self.cfg = type("Cfg", (), {"veto_p": 0.5, "min_p": 0.7})()

    def pick(self, *a):
        return []

    def no_copy(self, *a):
        return self.no


def test_a_value_the_pointer_says_copies_nothing_keeps_the_heads_draft():
    ctx = WORD_PROMPT + COLORS + _ids("chart", "re")
    head = _ids('"],', "colors", '":')
    cfg = HybridConfig(3, 4, "pointer", "prompt", head_p=0.0)
    assert base(head, ctx, len(WORD_PROMPT), cfg, INFO, _Pointer(0.9)) == head
    assert propose(head, ctx, len(WORD_PROMPT), cfg, INFO, _Pointer(0.9)) == head
    assert base(head, ctx, len(WORD_PROMPT), cfg, INFO, _Pointer(0.1)) == _ids("use", '"],', "colors")
    assert propose(head, ctx, len(WORD_PROMPT), cfg, INFO, _Pointer(0.1)) == _ids("use", '"],', "colors")
