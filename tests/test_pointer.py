"""The hybrid's pointer (drafting/pointer.py, rule ``pointer`` in drafting/rules/pointer.py), on hand-made vocabularies.

What a user relies on: at a value's opening quote the pointer's pick replaces the head's draft, "no copy"
keeps it; a lookup's copy of a value the pointer says copies nothing gives way to the head; the candidate
words are the shopper's (not a system message's, not a role name); and a pointer trained on replies that
copy a word learns to point at it, words it never saw included, and round-trips through its files.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_hybrid import _tids, _tinfo

from cartspec.drafting import SPECIAL_TEXT, HybridConfig, TokenInfo, propose

torch = pytest.importorskip("torch")

POINTER = HybridConfig(3, 4, "pointer", "prompt")


class FakePointer:
    """Picks ``pick`` (or nothing) wherever asked and says "no copy" with probability ``no``; records the
    contexts it was asked at."""

    def __init__(self, pick=(), no=0.0, veto_p=0.5):
        self._pick, self._no = list(pick), no
        self.cfg = type("Cfg", (), {"veto_p": veto_p, "min_p": 0.7})()
        self.asked = []

    def pick(self, context, prompt_len, k, texts, encode, special, prompt=None):
        self.asked.append(list(context))
        return self._pick[:k]

    def no_copy(self, context, prompt_len, texts, encode, special, prompt=None):
        return self._no


PROMPT = _tids("<s>", " brown", " jacket", ",", " size", " M", "\n")


def test_a_pick_at_a_values_opening_quote_replaces_the_heads_draft():
    info = _tinfo()
    ctx = PROMPT + _tids('{"', "keywords", '":', ' ["')
    head = _tids("xx", "et", "keywords")
    ptr = FakePointer(_tids("jack", "et"))
    assert propose(head, ctx, len(PROMPT), POINTER, info, ptr) == _tids("jack", "et", "keywords")
    assert ptr.asked == [ctx]
    # where the head closes the value (structure that differs), the pick is cut there
    head = _tids("xx", '"],', "keywords")
    assert propose(head, ctx, len(PROMPT), POINTER, info, ptr) == _tids("jack", '"],', "keywords")


def test_no_copy_keeps_the_heads_draft_and_no_value_start_asks_nothing():
    info = _tinfo()
    ctx = PROMPT + _tids('{"', "intent", '":', ' "')
    head = _tids("search", '",', "keywords")
    assert propose(head, ctx, len(PROMPT), POINTER, info, FakePointer()) == head
    ptr = FakePointer(_tids("jack"))
    for reply in (_tids('{"'), _tids('{"', "keywords"), _tids('{"', "keywords", '":', ' ["', "brown", '"],')):
        assert propose(_tids("xx", "et", "keywords"), PROMPT + reply, len(PROMPT), POINTER, info, ptr) \
            == _tids("xx", "et", "keywords")
    assert ptr.asked == []


def test_a_pick_after_a_drafted_opening_quote():
    info = _tinfo()
    ctx = PROMPT + _tids('{"', "keywords", '":')
    head = _tids(' ["', "xx", "keywords")  # the head opens the value, then drafts a word it does not know
    ptr = FakePointer(_tids("jack", "et"))
    assert propose(head, ctx, len(PROMPT), POINTER, info, ptr) == _tids(' ["', "jack", "et")
    assert ptr.asked == [ctx + _tids(' ["')]


def test_a_lookups_copy_of_a_value_the_pointer_says_copies_nothing_gives_way_to_the_head():
    info = _tinfo()
    # an earlier turn's reply in the prompt: the n-gram lookup from '{"' would copy its intent "search"
    prompt = _tids("<s>", "\n", '{"', "intent", '":', ' "', "search", '"}', "\n", " brown", "\n")
    ctx = prompt + _tids('{"', "intent")
    head = _tids('":', ' "', "ref")  # agrees with the lookup up to the value, which it knows is "ref"
    copy = propose(head, ctx, len(prompt), POINTER, info, FakePointer(no=0.1))
    assert copy == _tids('":', ' "', "search")  # the pointer says the value copies: the lookup stands
    assert propose(head, ctx, len(prompt), POINTER, info, FakePointer(no=0.9)) == head
    # text's copy inside a value the pointer says copies nothing is dropped too
    prompt = _tids("<s>", " brown", " running", " shoes", "\n")
    ctx = prompt + _tids('{"', "keywords", '":', ' ["', "run")
    head = _tids("xx", '"],', "keywords")
    assert propose(head, ctx, len(prompt), POINTER, info, FakePointer(no=0.1)) == _tids("ning", '"],', "keywords")
    assert propose(head, ctx, len(prompt), POINTER, info, FakePointer(no=0.9)) == head


def test_the_pointer_rule_needs_the_pointer_and_is_a_valid_setting(tmp_path):
    with pytest.raises(ValueError, match="pointer"):
        propose([1, 2, 3], PROMPT + _tids('{"'), len(PROMPT), POINTER, _tinfo())
    from cartspec.model.convert import ModelNotFound
    from cartspec.serving.spec import Speculative

    sp = Speculative(method="hybrid", model="domain", num_speculative_tokens=3, hybrid={"rule": "pointer"})
    cfg = sp.hybrid_config()
    assert cfg.rule == "pointer" and cfg.pointer.endswith("pointers/commerce")  # the bundled one
    assert HybridConfig.from_dict(cfg.to_dict()) == cfg
    assert sp.label == "hybrid-domain-pointer-g3"
    sp = Speculative(method="hybrid", model="domain", num_speculative_tokens=3,
                     hybrid={"rule": "pointer", "pointer": str(tmp_path)})
    with pytest.raises(ModelNotFound, match="cartspec draft pointer"):
        sp.hybrid_config()
    with pytest.raises(ValueError, match="pointer is a setting of the rules that read one"):
        Speculative(method="hybrid", model="domain", num_speculative_tokens=3,
                    hybrid={"rule": "text", "pointer": "commerce"})
    # a spec file written before the hybrid block: its flat fields are read into it
    old = Speculative(method="hybrid", model="domain", num_speculative_tokens=3, hybrid_rule="pointer",
                      hybrid_pointer="commerce", hybrid_head_p=0.8, prompt_lookup_max=5)
    assert old.hybrid == HybridConfig(n_max=5, rule="pointer", pointer="commerce", head_p=0.8)
    with pytest.raises(ValueError, match="not beside it as well"):
        Speculative(method="hybrid", model="domain", num_speculative_tokens=3, hybrid_rule="text",
                    hybrid={"rule": "pointer"})


# --- the candidates: the shopper's words ----------------------------------------------------------

_WORDS = ["<s>", "system", "user", "\n", " Find", " shoes", " by", " Nike", " only", " brand", " Acme", '{"', "brand",
          '":', ' "', '"}', "Nike", "Acme", " Zed", "Zed"]
_W = {t: i for i, t in enumerate(_WORDS)}


def _w(*texts):
    return [_W[t] for t in texts]


def test_candidates_are_the_shoppers_words_offered_as_written_and_in_lower_case():
    from cartspec.draft.pointer import candidates, value_key

    texts = [SPECIAL_TEXT if t == "<s>" else t for t in _WORDS]
    prompt = _w("<s>", "system", "\n", " Find", " shoes", "<s>", "user", "\n", " shoes", " by", " Nike", "<s>")
    ctx = prompt + _w('{"', "brand", '":', ' "')
    assert value_key(ctx, len(prompt), len(ctx) - 1, texts) == "brand"
    c = candidates(ctx, len(prompt), len(ctx) - 1, "brand", texts, SPECIAL_TEXT)
    words = [c.text[s:].replace(SPECIAL_TEXT, " ").split()[0] + ("/lower" if low else "") for s, low in zip(c.starts, c.lowered)]
    # not the system message's words, not the role names; "Nike" also offered as "nike"
    assert words == ["shoes", "by", "Nike", "Nike/lower"]
    assert c.tokens.shape == (4, 4) and c.tokens[2, 0] == _W[" Nike"] and c.tokens[2, 1] == _W[" by"]
    from cartspec.draft.pointer import FLAGS

    f = dict(zip(FLAGS, c.flags[2]))
    assert f["capital"] == 1 and f["lowered"] == 0 and f["in_reply"] == 0 and f["specials_1"] == 1
    assert dict(zip(FLAGS, c.flags[3]))["lowered"] == 1


def test_the_flags_that_read_the_reply_and_the_key():
    from cartspec.draft.pointer import FLAGS, candidates

    texts = [SPECIAL_TEXT if t == "<s>" else t for t in _WORDS]
    prompt = _w("<s>", "user", "\n", " Find", " Nike", " shoes", " by", " brand", " Nike", " only", "<s>")
    reply = _w('{"', "brand", '":', ' "', "Nike", '"}', '{"', "brand", '":', ' "')
    ctx = prompt + reply
    flags = {}
    for key in ("brand", "", "brand"):  # the key's flags are kept per prompt and key: asked again, the same
        c = candidates(ctx, len(prompt), len(ctx) - 1, key, texts, SPECIAL_TEXT)
        words = [c.text[s:].replace(SPECIAL_TEXT, " ").split()[0] + ("/lower" if low else "")
                 for s, low in zip(c.starts, c.lowered)]
        flags[key] = [(w, tuple(float(v) for f, v in zip(FLAGS, row) if f in ("in_reply", "is_key", "after_key")))
                      for w, row in zip(words, c.flags)]
    # (in_reply, is_key, after_key): "Nike" is in the reply, "brand" too (as a key) and is the key's name;
    # the second "Nike" (and its lower case) follows " brand"
    assert flags["brand"] == [("Find", (0, 0, 0)), ("Find/lower", (0, 0, 0)), ("Nike", (1, 0, 0)),
                              ("Nike/lower", (1, 0, 0)), ("shoes", (0, 0, 0)), ("by", (0, 0, 0)),
                              ("brand", (1, 1, 0)), ("Nike", (1, 0, 1)), ("Nike/lower", (1, 0, 1)), ("only", (0, 0, 0))]
    assert flags[""] == [(w, (r, 0, 0)) for w, (r, _, _) in flags["brand"]]  # no key: neither key flag


# --- training: a pointer learns to point ----------------------------------------------------------

def _synthetic(n, brands, seed):
    """Requests "Find shoes by BRAND only" (words in varying order) replied {"brand": "BRAND"}."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = brands[rng.integers(len(brands))]
        words = [" Find", " shoes", " by", b, " only"] if rng.random() < 0.5 else [" Find", " by", b, " shoes"]
        prompt = _w("<s>", "user", "\n") + [_W[w] for w in words] + _w("<s>")
        reply = _w('{"', "brand", '":', ' "', b.strip(), '"}')
        out.append((prompt + reply, len(prompt)))
    return out


def test_a_trained_pointer_points_at_the_copied_word_and_round_trips(tmp_path):
    from safetensors.torch import save_file

    from cartspec.draft.pointer import Pointer, train_pointer

    words = _WORDS
    model = tmp_path / "model"
    model.mkdir()
    torch.manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(len(words), 16)}, str(model / "model.safetensors"))
    texts = [SPECIAL_TEXT if t == "<s>" else t for t in words]

    def encode(text):
        ids, i = [], 0
        while i < len(text):
            best = max((t for t in words[1:] if text.startswith(t, i)), key=len, default=None)
            ids.append(_W[best] if best else -1)
            i += len(best) if best else 1
        return ids

    info = TokenInfo.from_texts(texts, special=[0], encode=encode)
    train = _synthetic(200, [" Nike", " Acme"], 0)
    dev = _synthetic(40, [" Zed"], 1)  # a brand it never saw
    log = train_pointer(model, train, info, tmp_path / "ptr", epochs=15, dev=dev, log=lambda m: None,
                        target={"name": "tiny", "digest": "x"})
    assert log["epochs"][-1]["dev_copied_top1"] >= 0.9, log["epochs"]
    conf = json.loads((tmp_path / "ptr" / "config.json").read_text())
    assert conf["cartspec"]["target"] == {"name": "tiny", "digest": "x"}  # what check_head reads
    ptr = Pointer.load(tmp_path / "ptr", model)
    toks, P = dev[0]
    q = toks.index(_W[' "'], P)
    assert ptr.pick(toks[:q + 1], P, 2, texts, encode, SPECIAL_TEXT)[:1] == [_W["Zed"]]
    save_file({"model.embed_tokens.weight": torch.randn(len(words), 8)}, str(model / "model.safetensors"))
    with pytest.raises(ValueError, match="hidden size"):
        Pointer.load(tmp_path / "ptr", model)
    with pytest.raises(FileNotFoundError, match="cartspec draft pointer"):
        Pointer.load(tmp_path, model)


def test_the_numpy_scorer_is_the_nets_function_split_per_prompt():
    """What the engine runs at a value's opening (``Scorer``: the prompt's share of the first layer once,
    the rest per value) gives the trained net's probabilities: the same picks in the server as in training."""
    from cartspec.drafting.pointer import _DYNAMIC, FLAGS, N_SLOTS, PointerConfig, PointerNet, Scorer

    torch.manual_seed(0)
    cfg = PointerConfig(dim=8, hidden=16, embed_dim=12)
    net = PointerNet(cfg).eval()
    with torch.no_grad():
        net.pad.normal_()
        table = net.proj(torch.randn(50, 12))
    sc = Scorer(net, table)
    rng = np.random.default_rng(0)
    for keys in ([3, 7], [], [9]):
        n = 11
        tokens = rng.integers(-1, 50, size=(n, N_SLOTS))
        flags = rng.random((n, len(FLAGS))).astype(np.float32)
        dynamic = flags[:, _DYNAMIC].copy()
        static = flags.copy()
        static[:, _DYNAMIC] = 0
        got = sc.probs(sc.prompt_part(tokens, static), dynamic, keys, 4)
        with torch.no_grad():
            want = net.scores(table, torch.from_numpy(tokens)[None], torch.from_numpy(flags)[None],
                              torch.ones(1, n, dtype=torch.bool), torch.tensor([keys or [-1]]),
                              torch.tensor([4]))[0].softmax(0).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_pointer_trained_for_another_model_is_refused(tmp_path):
    import shutil

    from cartspec.model.registry import POINTERS_DIR, HeadMismatch, check_spec_head
    from cartspec.serving.spec import DeploymentSpec, Speculative

    other = tmp_path / "other"
    shutil.copytree(POINTERS_DIR / "commerce", other)
    conf = json.loads((other / "config.json").read_text())
    conf["cartspec"]["target"] = {"name": "someone-else", "digest": "0123456789abcdef"}
    (other / "config.json").write_text(json.dumps(conf))
    spec = DeploymentSpec(model="commerce", speculative=Speculative(
        method="hybrid", model="domain", num_speculative_tokens=3, hybrid={"rule": "pointer", "pointer": str(other)}))
    with pytest.raises(HeadMismatch, match="cartspec draft pointer"):
        check_spec_head(spec)
    assert check_spec_head(spec, force=True, warn=lambda m: None) == "match"  # the head's verdict; warned


def test_keep_best_ends_with_the_epoch_that_checked_best_never_below_a_warm_start():
    """A refresh's pointer keeps its best epoch on the held-out value starts: trained here on picks the held-out
    set contradicts (the same starts, "no copy" held out), so training makes it check worse, and the kept net
    checks as well as the best of its start and its epochs, not as its last epoch."""
    import torch

    from cartspec.draft.pointer import Example, _fit, correct
    from cartspec.drafting.pointer import FLAGS, N_SLOTS, PointerConfig, PointerNet

    torch.manual_seed(0)
    embed = torch.randn(50, 16)
    net = PointerNet(PointerConfig(embed_dim=16))
    rng = np.random.default_rng(0)

    def ex(positive):
        toks = rng.integers(1, 50, size=(5, N_SLOTS))
        return Example(tokens=toks, flags=np.zeros((5, len(FLAGS)), dtype=np.float32), key_ids=[3], quote=4,
                       positive=positive)

    train = [ex([1]) for _ in range(40)]
    dev = [Example(e.tokens, e.flags, e.key_ids, e.quote, [0]) for e in train]  # "no copy" everywhere
    _fit(net, embed, dev, dev, 3, 0.05, 8, 0, lambda row: None)  # a warm start: it learnt the held-out picks
    start = correct(net, embed, dev)
    assert start > len(dev) // 2
    hist = _fit(net, embed, train, dev, 4, 0.05, 8, 0, lambda row: None, keep_best=True, from_start=True)
    by_epoch = [round(r["dev_no_copy_kept"] * len(dev)) for r in hist]
    assert by_epoch[-1] < start  # training on the contradicted picks made the last epoch worse...
    assert correct(net, embed, dev) == max([start] + by_epoch)  # ...and the kept net is the best one
    assert hist[-1]["kept_epoch"] == ([start] + by_epoch).index(max([start] + by_epoch))
