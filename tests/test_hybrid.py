"""The hybrid drafter (EAGLE-3 + prompt lookup): its lookup, its combination rule, its settings."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from dataclasses import dataclass

from cartspec.drafting import KEY, HybridConfig, TokenInfo, lookup, propose, value_start
from cartspec.drafting import RULES
from cartspec.drafting.copying import word_rest
from cartspec.drafting.prompt import Prompt, prompt_of
from cartspec.drafting.rules import BY_NAME, Step, draft
from cartspec.vllm_plugin.hybrid import context_for, hybrid_drafts


def test_lookup_match_overrides_the_heads_draft():
    # prompt: "... red denim jacket ..." ; the reply has just written "red denim"
    prompt = [1, 50, 60, 70, 80, 2]          # 60 70 80 = "red denim jacket"
    reply = [9, 9, 60, 70]                   # ... "red denim"
    head = [81, 3, 4]                        # the head guesses a wrong word, then structure
    draft = propose(head, prompt + reply, len(prompt), HybridConfig(n_min=2, n_max=4, rule="lookup"))
    # the prompt's continuation where it reaches (it stops at the prompt's end), the head's token after
    assert draft == [80, 2, 4]
    # searching prompt + reply, the continuation runs on into the reply
    assert propose(head, prompt + reply, len(prompt), HybridConfig(2, 4, "lookup", "context")) == [80, 2, 9]


def test_no_match_keeps_the_heads_draft():
    prompt = [1, 50, 60, 70, 80, 2]
    reply = [9, 33, 44]                      # "33 44" is nowhere earlier
    head = [5, 6, 7]
    for rule in ("lookup", "agree"):
        assert propose(head, prompt + reply, len(prompt), HybridConfig(rule=rule)) == head


@dataclass(frozen=True)
class Scripted(Step):
    """A step whose n-gram lookup proposes ``look``, whatever the context: the rules alone, on a given copy."""

    look: tuple = ()

    def ngram(self) -> list[int]:
        return list(self.look)[:len(self.head)]


def combine(head, look, rule="lookup"):
    return draft(Scripted(list(head), [0], 1, HybridConfig(rule=rule), look=tuple(look)))


def test_combine_rules_per_position():
    assert combine([1, 2, 3], [7]) == [7, 2, 3]           # lookup covers position 0, head fills 1..2
    assert combine([1, 2, 3], [7, 8, 9, 10]) == [7, 8, 9]  # never more than γ
    assert combine([1, 2, 3], []) == [1, 2, 3]
    assert combine([1, 2, 3], [1, 8], "agree") == [1, 2, 3]  # agrees on the first token: the head's chain stays
    assert combine([1, 2, 3], [7, 8], "agree") == [7, 8, 3]
    assert combine([1, 2, 3], [7, 8], "head") == [1, 2, 3]
    with pytest.raises(ValueError, match="hybrid rule must be one of"):
        HybridConfig(rule="best")


def test_every_rule_is_one_object_behind_the_rule_interface():
    assert set(BY_NAME) == set(RULES) == {"lookup", "agree", "head", "anchor", "text", "pointer", "schema",
                                          "pointer-schema"}
    for name, rule in BY_NAME.items():
        assert rule.name == name and callable(rule.draft)
    # what a rule needs is refused up front, with what is missing
    with pytest.raises(ValueError, match="needs the tokens' text"):
        draft(Scripted([1, 2], [0], 1, HybridConfig(rule="anchor")))
    with pytest.raises(ValueError, match="needs the trained pointer"):
        info = TokenInfo.from_texts(["a", "b", "c"], encode=lambda t: [0])
        draft(Scripted([1, 2], [0], 1, HybridConfig(rule="pointer"), info=info))


def test_prompt_scope_ignores_matches_in_the_reply():
    prompt = [1, 2, 3]
    reply = [40, 41, 42, 40, 41]             # "40 41" occurred in the reply, not the prompt
    ctx = prompt + reply
    assert lookup(ctx, 3, 2, 4) == [42, 40, 41]
    assert lookup(ctx, 3, 2, 4, limit=len(prompt)) == []
    # a prompt match stops at the end of the prompt
    assert lookup([5, 6, 7, 8, 5, 6], 3, 2, 4, limit=4) == [7, 8]
    assert lookup([5, 6, 7, 8, 5, 6], 3, 2, 4, limit=3) == [7]


def test_lookup_is_vllms_ngram_proposal():
    ngram = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer")
    rng = random.Random(0)
    for _ in range(300):
        L = rng.randint(2, 60)
        ctx = np.array([rng.randint(0, 5) for _ in range(L)], dtype=np.int32)
        n_min, n_max, k = rng.randint(1, 3), rng.randint(3, 5), rng.randint(1, 5)
        want = ngram._find_longest_matched_ngram_and_propose_tokens(ctx, n_min, n_max, 4096, k).tolist()
        assert lookup(ctx.tolist(), k, n_min, n_max) == want, (ctx.tolist(), n_min, n_max, k)


def test_the_prompts_ngram_index_proposes_what_the_scan_does():
    from cartspec.drafting.lookup import lookup_scan

    rng = random.Random(1)
    for _ in range(2000):
        P = rng.randint(1, 40)
        ctx = [rng.randint(0, 4) for _ in range(P + rng.randint(0, 12))]
        n_min = rng.randint(1, 3)
        n_max, k = rng.randint(n_min, 5), rng.randint(1, 5)
        want = lookup_scan(ctx, k, n_min, n_max, limit=P)
        assert lookup(ctx, k, n_min, n_max, limit=P) == want, (ctx, P, n_min, n_max, k)
        assert lookup(np.array(ctx), k, n_min, n_max, limit=P) == want
        # the runner hands the request's kept Prompt: the same proposal, read from its index
        assert lookup(ctx, k, n_min, n_max, limit=P, prompt=Prompt(ctx[:P])) == want


def test_a_prompt_keeps_what_the_rules_read_of_it():
    texts = ["a", "B", "\x00", " c"]
    pr = Prompt([1, 0, 2, 3, 1])
    assert (pr.first(1), pr.first(3), pr.first(9)) == (0, 3, -1)
    assert pr.text(texts) == "Ba\x00 cB" and pr.folded(texts) == "ba\x00 cb"
    assert pr.index(1, 2) is pr.index(1, 2)
    # found by its tokens where no caller keeps it; a kept one of another length is not the context's
    assert prompt_of([1, 0, 2, 3, 1, 7], 5) is prompt_of((1, 0, 2, 3, 1), 5)
    assert prompt_of([1, 0, 2, 3, 1, 7], 5, pr) is pr
    assert prompt_of([1, 0, 2], 3, pr).tokens == (1, 0, 2)


def test_context_for_appends_this_steps_accepted_tokens():
    row = np.array([1, 2, 3, 0, 0])
    assert context_for(row, 3, [7, 8, -1, -1], vocab_size=100) == [1, 2, 3, 7, 8]
    assert context_for(row, 3, None, vocab_size=100) == [1, 2, 3]
    assert context_for(row, 2, [100], vocab_size=100) == [1, 2]  # out of vocabulary: a padding marker
    # with the request's kept prompt only the reply is read from the row
    assert context_for(np.array([0, 0, 3, 4, 0]), 4, [7, -1], 100, prompt=Prompt([1, 2])) == [1, 2, 3, 4, 7]


def test_config_round_trips_and_rejects_bad_settings():
    cfg = HybridConfig(3, 5, "agree", "context")
    assert HybridConfig.from_dict(cfg.to_dict()) == HybridConfig.from_dict(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="not JSON"):
        HybridConfig.from_dict("rule=lookup")
    with pytest.raises(ValueError, match="must be an object"):
        HybridConfig.from_dict({"rule": "lookup", "gamma": 3})
    with pytest.raises(ValueError, match="rule"):
        HybridConfig(rule="nope")
    with pytest.raises(ValueError, match="n_min"):
        HybridConfig(n_min=4, n_max=2)


class _Batch:
    def __init__(self, rows, num_tokens, prompt_lens, vocab_size=100):
        self.num_reqs = len(rows)
        self.token_ids_cpu = np.zeros((len(rows), 32), dtype=np.int32)
        for i, r in enumerate(rows):
            self.token_ids_cpu[i, :len(r)] = r
        self.num_tokens_no_spec = np.array(num_tokens)
        self.num_prompt_tokens = np.array(prompt_lens)
        self.vocab_size = vocab_size
        self.req_ids = [f"req-{i}" for i in range(len(rows))]


class _Mask:
    def __init__(self, values):
        self.np = np.array(values)


class _Runner:
    def __init__(self, batch, discard):
        self.input_batch = batch
        self.discard_request_mask = _Mask(discard)


def test_runner_drafts_use_this_steps_tokens_in_padded_mode():
    torch = pytest.importorskip("torch")
    # request 0: prompt 1 50 60 70 80 2, output so far 9; this step accepted 60 then the bonus 70
    # request 1: no match anywhere; request 2: still prefilling (discarded): drafts untouched
    batch = _Batch([[1, 50, 60, 70, 80, 2, 9], [1, 2, 3, 4], [5, 6, 5]], [7, 4, 3], [6, 3, 3])
    runner = _Runner(batch, [False, False, True])
    heads = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33]], dtype=torch.int32)
    sampled = torch.tensor([[60, 70, -1, -1], [4, -1, -1, -1], [6, -1, -1, -1]])
    out = hybrid_drafts(runner, heads, sampled, HybridConfig(2, 4, "lookup", "prompt"))
    assert out.tolist() == [[80, 2, 13], [21, 22, 23], [31, 32, 33]]
    assert out.dtype == torch.int32


def test_the_runner_makes_each_requests_prompt_once_and_forgets_a_request_that_left():
    torch = pytest.importorskip("torch")
    batch = _Batch([[1, 50, 60, 70, 80, 2, 9], [1, 2, 3, 4]], [7, 4], [6, 3])
    runner = _Runner(batch, [False, False])
    heads = torch.tensor([[11, 12, 13], [21, 22, 23]])
    sampled = torch.tensor([[60, 70, -1, -1], [4, -1, -1, -1]])
    cfg = HybridConfig(2, 4, "lookup", "prompt")
    assert hybrid_drafts(runner, heads, sampled, cfg).tolist() == [[80, 2, 13], [21, 22, 23]]
    kept = dict(runner._cartspec_prompts)
    assert {r: p.tokens for r, p in kept.items()} == {"req-0": (1, 50, 60, 70, 80, 2), "req-1": (1, 2, 3)}
    hybrid_drafts(runner, heads, sampled, cfg)
    assert all(runner._cartspec_prompts[r] is p for r, p in kept.items())  # made once per request
    # request 0 finished; another took its row: its prompt is its own, and request 0's is dropped
    batch.req_ids = ["req-2", "req-1"]
    batch.token_ids_cpu[0, :7] = [5, 6, 7, 8, 9, 5, 6]
    batch.num_prompt_tokens = np.array([5, 3])
    assert hybrid_drafts(runner, heads, torch.tensor([[-1] * 4, [4, -1, -1, -1]]), cfg).tolist()[0] == [7, 8, 9]
    assert set(runner._cartspec_prompts) == {"req-2", "req-1"}
    assert runner._cartspec_prompts["req-2"].tokens == (5, 6, 7, 8, 9)


def test_the_hybrid_patch_drafts_only_in_a_runner_whose_vllm_config_asks(capsys):
    import types

    from cartspec.vllm_plugin import hybrid as hybrid_patch
    from cartspec.vllm_plugin.registry import run

    class Runner:
        def __init__(self, extra):
            self.vllm_config = types.SimpleNamespace(additional_config=extra)
            self.speculative_config = types.SimpleNamespace(method="ngram")  # no head: the draft passes on

        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *a, **kw):
            return [[1, 2]]

    original = Runner.propose_draft_token_ids
    mod = types.ModuleType(hybrid_patch.MODULE)
    mod.GPUModelRunner = Runner
    statuses = {}
    assert run(hybrid_patch.PATCH, mod, statuses).status == "applied"  # in every process
    wrapped = Runner.propose_draft_token_ids
    assert wrapped is not original
    assert run(hybrid_patch.PATCH, mod, statuses).status == "applied" and Runner.propose_draft_token_ids is wrapped
    assert "cartspec patch: hybrid applied" in capsys.readouterr().err
    plain = Runner({})
    assert plain.propose_draft_token_ids(None, None) == [[1, 2]] and hybrid_patch.runner_config(plain) is None
    asked = Runner({KEY: HybridConfig(rule="lookup").to_dict()})
    assert asked.propose_draft_token_ids(None, None) == [[1, 2]]
    assert hybrid_patch.runner_config(asked) == HybridConfig(rule="lookup")
    assert "cartspec: hybrid drafts in this runner" in capsys.readouterr().err


def test_hybrid_spec_runs_eagle3_underneath_with_its_settings_in_vllms_additional_config(tmp_path):
    from cartspec.bench.plan import parse_deployment
    from cartspec.serving.spec import Speculative

    d = parse_deployment("hybrid:domain:3", "commerce")
    sp = d.speculative
    assert (sp.method, sp.model, sp.num_speculative_tokens) == ("hybrid", "domain", 3)
    assert d.label == "hybrid-domain-g3"
    assert sp.vllm_config("/heads/domain") == {"num_speculative_tokens": 3, "method": "eagle3",
                                                "model": "/heads/domain"}
    extra = sp.additional_config()
    assert HybridConfig.from_dict(extra[KEY]) == sp.hybrid_config()
    tuned = Speculative(method="hybrid", model="domain", num_speculative_tokens=5,
                        hybrid={"n_min": 3, "n_max": 5, "rule": "agree", "scope": "context"})
    assert tuned.hybrid_config() == HybridConfig(3, 5, "agree", "context")
    assert Speculative(method="eagle3", model="domain", num_speculative_tokens=3).additional_config() == {}
    with pytest.raises(ValueError, match="needs model"):
        Speculative(method="hybrid", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="setting of method 'hybrid'"):
        Speculative(method="eagle3", model="domain", num_speculative_tokens=3, hybrid={"rule": "agree"})
    with pytest.raises(ValueError, match="settings of method 'hybrid'"):  # a spec file's flat field
        Speculative(method="eagle3", model="domain", num_speculative_tokens=3, hybrid_rule="agree")
    with pytest.raises(ValueError, match="n_min <= n_max"):
        Speculative(method="hybrid", model="domain", num_speculative_tokens=3, hybrid={"n_min": 5, "n_max": 2})


def test_the_server_command_carries_the_hybrids_settings_only_for_a_hybrid(tiny_llama_dir, tmp_path):
    from cartspec.serving.server import VllmServer
    from cartspec.serving.spec import DeploymentSpec, Speculative

    def command(sp):
        spec = DeploymentSpec(model=str(tiny_llama_dir), speculative=sp)
        return VllmServer(spec, log_dir=tmp_path, model_dir=tiny_llama_dir, head_dir=tmp_path).command()

    cmd = command(Speculative(method="hybrid", model="h", num_speculative_tokens=3, hybrid={"rule": "lookup"}))
    extra = json.loads(cmd[cmd.index("--additional-config") + 1])
    assert HybridConfig.from_dict(extra[KEY]) == HybridConfig(rule="lookup")
    # the target's default where the spec has no hybrid block: no pointer was trained for the tiny model
    cmd = command(Speculative(method="hybrid", model="h", num_speculative_tokens=3))
    assert json.loads(cmd[cmd.index("--additional-config") + 1])[KEY]["rule"] == "head"
    assert "--additional-config" not in command(Speculative(method="ngram", num_speculative_tokens=3))


def test_draft_acceptance_cli_rejects_bad_hybrid_settings(tmp_path):
    from typer.testing import CliRunner

    from cartspec.cli import app

    runner = CliRunner()
    out = str(tmp_path / "a.json")
    res = runner.invoke(app, ["draft", "acceptance", "--method", "hybrid", "--out", out])
    assert res.exit_code == 2 and "--head is required with --method hybrid" in res.output
    res = runner.invoke(app, ["draft", "acceptance", "--method", "hybrid", "--head", "domain", "--rule", "best",
                              "--out", out])
    assert res.exit_code == 2 and "hybrid rule must be one of" in res.output
    res = runner.invoke(app, ["draft", "acceptance", "--method", "eagle3", "--head", "domain", "--scope", "prompt",
                              "--out", out])
    assert res.exit_code == 2 and "settings of --method hybrid" in res.output


# --- the anchor rule, on a hand-made vocabulary -------------------------------------------------------

_TEXTS = ["<s>", "\n", '{"', '":', ' "', '",', '"}', ' ["', '"],', "keywords", "colors", "intent", "search",
          "ref", "cal", " cal", "vin", " k", "lein", " only", " brown", "brown", "jack", "et", " size", "xx"]
_ID = {t: i for i, t in enumerate(_TEXTS)}


def _ids(*texts):
    return [_ID[t] for t in texts]


def _info():
    return TokenInfo.from_texts(_TEXTS, special=[0])


ANCHOR = HybridConfig(3, 4, "anchor", "prompt")


def test_token_info_classes_and_twins():
    info = _info()
    assert info.twin[_ID["cal"]] == _ID[" cal"] and info.twin[_ID[" cal"]] == _ID["cal"]
    assert info.twin[_ID["vin"]] == -1 and info.twin[_ID["<s>"]] == -1
    assert info.structure[_ID['",']] and info.structure[_ID['"],']] and not info.structure[_ID["cal"]]
    assert not info.structure[_ID["<s>"]] and not info.content[_ID["<s>"]]
    assert info.opens[_ID[' "']] and info.opens[_ID[' ["']] and not info.opens[_ID['",']]
    assert info.bracket[_ID[' ["']] == 1 and info.bracket[_ID['"],']] == -1


def test_anchor_continues_a_value_from_the_prompts_spaced_word():
    # prompt: "... cal vin k lein only"; the reply has opened a brands value and written "cal" (no space)
    prompt = _ids("<s>", " brown", " cal", "vin", " k", "lein", " only", "\n")
    reply = _ids('{"', "colors", '":', ' ["', "cal")
    ctx = prompt + reply
    assert value_start(ctx, len(prompt), _info())
    head = _ids("xx", "et", "jack")                 # the head does not know the brand
    # "cal" matches nowhere as an id, but its twin " cal" does: the prompt's continuation is drafted
    assert propose(head, ctx, len(prompt), ANCHOR, _info()) == _ids("vin", " k", "lein")
    # ... up to where the head closes the array (its token there is structure and differs)
    head = _ids("xx", "et", '"],')
    assert propose(head, ctx, len(prompt), ANCHOR, _info()) == _ids("vin", " k", '"],')
    # the plain lookup has no 3-token match and keeps the head's draft
    assert propose(head, ctx, len(prompt), HybridConfig(3, 4, "lookup"), _info()) == head


def test_anchor_stops_where_the_head_closes_the_value():
    prompt = _ids("<s>", " brown", " cal", "vin", " k", "lein", " only", "\n")
    ctx = prompt + _ids('{"', "colors", '":', ' ["', "cal", "vin", " k", "lein")
    # lookup (3-4 tokens) continues with " only"; the head closes the array there: its tokens from there on
    head = _ids('"],', "keywords", '":')
    assert propose(head, ctx, len(prompt), HybridConfig(3, 4, "lookup"), _info())[0] == _ID[" only"]
    assert propose(head, ctx, len(prompt), ANCHOR, _info()) == head
    # a word the head does not close on: the lookup's token stays, the head's fill the rest
    head2 = _ids("brown", "keywords", '":')
    assert propose(head2, ctx, len(prompt), ANCHOR, _info()) == _ids(" only", "\n", '":')


def test_anchor_keeps_the_head_on_a_values_first_token_where_they_disagree():
    # an earlier turn's JSON in the prompt: the lookup would copy its value ("search") into this reply
    prompt = _ids("<s>", '{"', "intent", '":', ' "', "search", '"}', "\n")
    ctx = prompt + _ids('{"', "intent", '":', ' "')
    head = _ids("ref", '",', "keywords")
    assert propose(head, ctx, len(prompt), HybridConfig(3, 4, "lookup"), _info())[0] == _ID["search"]
    assert propose(head, ctx, len(prompt), ANCHOR, _info()) == head
    # where they agree on the first token the lookup's continuation is kept
    head = _ids("search", "xx", "keywords")
    assert propose(head, ctx, len(prompt), ANCHOR, _info()) == _ids("search", '"}', "\n")


def test_anchor_does_not_start_on_a_key_or_outside_the_prompt():
    info = _info()
    prompt = _ids("<s>", " brown", " size", " cal", "vin", "\n")
    # "colors" right after an opening quote that follows a comma outside an array: a key, not a value
    ctx = prompt + _ids('{"', "intent", '":', ' "', "ref", '",', ' "', "cal")
    assert not value_start(ctx, len(prompt), info)
    head = _ids("xx", "et", '":')
    assert propose(head, ctx, len(prompt), ANCHOR, info) == head
    # inside an array an item after '",' is a value
    ctx = prompt + _ids('{"', "colors", '":', ' ["', "brown", '",', ' "', "cal")
    assert value_start(ctx, len(prompt), info)
    assert propose(head, ctx, len(prompt), ANCHOR, info) == _ids("vin", "\n", '":')
    # a word that is nowhere in the prompt: the head's draft
    ctx = prompt + _ids('{"', "colors", '":', ' ["', "jack")
    assert propose(head, ctx, len(prompt), ANCHOR, info) == head


def test_anchor_needs_token_info_and_is_a_valid_setting():
    with pytest.raises(ValueError, match="TokenInfo"):
        propose([1, 2, 3], [4, 5, 6, 7], 2, ANCHOR)
    assert HybridConfig.from_dict(ANCHOR.to_dict()) == ANCHOR


# --- the text rule: anchor plus a match on the text of a value, on a hand-made vocabulary ----------------

_TTEXTS = _TEXTS + [" jacket", ",", " M", " running", " shoes", "run", "ning", " Nike", "nike", " air", " Air", "ket",
                    "j", "acket", "x"]
_TID = {t: i for i, t in enumerate(_TTEXTS)}


def _tids(*texts):
    return [_TID[t] for t in texts]


def _tencode(text):
    """Greedy longest-prefix tokenization over the hand-made vocabulary (-1 for a character it lacks)."""
    ids, i = [], 0
    while i < len(text):
        best = max((t for t in _TTEXTS[1:] if text.startswith(t, i)), key=len, default=None)
        if best is None:
            ids.append(-1)
            i += 1
        else:
            ids.append(_TID[best])
            i += len(best)
    return ids


def _tinfo():
    return TokenInfo.from_texts(_TTEXTS, special=[0], encode=_tencode)


TEXT = HybridConfig(3, 4, "text", "prompt")


def test_text_is_a_valid_setting_and_needs_texts_and_encode():
    assert HybridConfig.from_dict(TEXT.to_dict()) == TEXT
    from cartspec.serving.spec import Speculative

    sp = Speculative(method="hybrid", model="domain", num_speculative_tokens=3, hybrid={"rule": "text"})
    assert sp.hybrid_config().rule == "text"
    with pytest.raises(ValueError, match="TokenInfo"):
        propose([1, 2, 3], [4, 5, 6, 7], 2, TEXT)
    with pytest.raises(ValueError, match="encode"):
        propose([1, 2, 3], [4, 5, 6, 7], 2, TEXT, TokenInfo.from_texts(_TTEXTS, special=[0]))
    info = _tinfo()
    assert info.texts[0] == "\x00" and info.texts[_TID[" jacket"]] == " jacket" and info.encode is _tencode


def test_text_continues_a_value_whose_first_token_splits_the_prompts_word_differently():
    info = _tinfo()
    prompt = _tids("<s>", " brown", " jacket", ",", " size", " M", "\n")
    ctx = prompt + _tids('{"', "keywords", '":', ' ["', "jack")   # the reply writes "jack" + "et"
    head = _tids("xx", "brown", "keywords")                       # the head does not know the word
    # neither the n-gram lookup nor the anchor's token/twin search finds "jack": the head's draft
    assert propose(head, ctx, len(prompt), HybridConfig(3, 4, "anchor"), info) == head
    # the prompt's text after "jack" in " jacket", re-encoded: "et" "," " size"
    assert propose(head, ctx, len(prompt), TEXT, info) == _tids("et", ",", " size")
    # cut where the head closes the value (its token is structure and differs)
    head = _tids("xx", '"],', "keywords")
    assert propose(head, ctx, len(prompt), TEXT, info) == _tids("et", '"],', "keywords")


def test_text_continues_a_multi_token_value_from_the_prompts_text():
    info = _tinfo()
    prompt = _tids("<s>", " brown", " running", " shoes", " size", " M", "\n")
    head = _tids("xx", "brown", "keywords")
    reply = _tids('{"', "keywords", '":', ' ["', "run")
    assert propose(head, prompt + reply, len(prompt), TEXT, info) == _tids("ning", " shoes", " size")
    reply = reply + _tids("ning")                                  # "running" so far, in two tokens
    assert propose(head, prompt + reply, len(prompt), TEXT, info) == _tids(" shoes", " size", " M")
    # the prompt's turn ends at a special token: the continuation stops there
    prompt2 = _tids("<s>", " brown", " running", " shoes", "<s>", " size")
    assert propose(head, prompt2 + reply, len(prompt2), TEXT, info) == _tids(" shoes", "brown", "keywords")


def test_text_drafts_nothing_outside_a_value_or_without_a_word_start_match():
    info = _tinfo()
    prompt = _tids("<s>", " brown", " jacket", ",", " size", " M", "\n")
    head = _tids("xx", "brown", "keywords")
    for reply in (_ids('{"'), _ids('{"', "keywords", '":'), _ids('{"', "keywords", '":', ' ["')):
        assert propose(head, prompt + reply, len(prompt), TEXT, info) == head  # before any value's text
    assert propose(head, prompt + _tids('{"', "jack"), len(prompt), TEXT, info) == head  # a key
    # a key after a closed value, outside an array
    reply = _tids('{"', "intent", '":', ' "', "search", '",', ' "', "jack")
    assert propose(head, prompt + reply, len(prompt), TEXT, info) == head
    # "ket" is inside " jacket", not at a word start
    reply = _tids('{"', "keywords", '":', ' ["', "ket")
    assert propose(head, prompt + reply, len(prompt), TEXT, info) == head
    # from the first character on: "j" goes on as the prompt's word starting with j
    reply = _tids('{"', "keywords", '":', ' ["', "j")
    assert propose(head, prompt + reply, len(prompt), TEXT, info) == _tids("acket", ",", " size")
    # a character that starts no word of the prompt: the head's draft
    reply = _tids('{"', "keywords", '":', ' ["', "x")
    assert propose(head, prompt + reply, len(prompt), TEXT, info) == head
    # the reply's own text does not count, only the prompt's
    reply = _tids('{"', "keywords", '":', ' ["', "run", "ning", '",', ' "', "run")
    assert propose(head, prompt + reply, len(prompt), TEXT, info) == head
    # a chat template's role name right after a special token is no one's word
    prompt = _tids("<s>", "run", "ning", "\n", " brown", "\n")
    reply = _tids('{"', "keywords", '":', ' ["', "run", "ning")
    assert propose(head, prompt + reply, len(prompt), TEXT, info) == head


def test_text_takes_the_latest_occurrence_and_follows_the_replys_lower_case():
    info = _tinfo()
    head = _tids("xx", "brown", "keywords")
    reply = _tids('{"', "keywords", '":', ' ["', "jack")
    prompt = _tids("<s>", " jacket", ",", " size", " M", "\n", " jacket", " brown", "\n")
    assert propose(head, prompt + reply, len(prompt), TEXT, info) == _tids("et", " brown", "\n")
    prompt = _tids("<s>", " brown", " Nike", " Air", " shoes", "\n")
    reply = _tids('{"', "keywords", '":', ' ["', "nike")
    assert propose(head, prompt + reply, len(prompt), TEXT, info) == _tids(" air", " shoes", "\n")


def test_text_behaves_like_anchor_where_a_lookup_matches_or_no_text_does():
    info = _tinfo()
    anchor = HybridConfig(3, 4, "anchor", "prompt")
    p1 = _tids("<s>", " brown", " cal", "vin", " k", "lein", " only", "\n")
    p2 = _tids("<s>", '{"', "intent", '":', ' "', "search", '"}', "\n")
    p3 = _tids("<s>", " brown", " size", " cal", "vin", "\n")
    cases = [
        (p1, _tids('{"', "colors", '":', ' ["', "cal")),                     # the anchor's twin search
        (p1, _tids('{"', "colors", '":', ' ["', "cal", "vin", " k", "lein")),  # the n-gram lookup
        (p2, _tids('{"', "intent", '":', ' "')),                              # a value's first position
        (p3, _tids('{"', "intent", '":', ' "', "ref", '",', ' "', "cal")),    # a key
        (p3, _tids('{"', "colors", '":', ' ["', "brown", '",', ' "', "cal")),
        (p3, _tids('{"', "colors", '":', ' ["', "jack")),                    # not in the prompt
    ]
    heads = [_tids("xx", "et", "jack"), _tids("xx", "et", '"],'), _tids('"],', "keywords", '":'),
             _tids("brown", "keywords", '":'), _tids("ref", '",', "keywords"), _tids("search", "xx", "keywords")]
    for prompt, reply in cases:
        for head in heads:
            if any(info.structure[t] for t in head) and word_rest(prompt + reply, len(prompt), 3, info):
                # the head closes "cal" inside the prompt's "calvin", or closes a word of its own: rule text drafts
                # the word's rest, then the head's close
                continue
            assert (propose(head, prompt + reply, len(prompt), TEXT, info)
                    == propose(head, prompt + reply, len(prompt), anchor, info)), (reply, head)
    closing = _tids('"],', "keywords", '":')
    assert propose(closing, p1 + cases[0][1], len(p1), TEXT, info) == _tids("vin", '"],', "keywords")
    assert propose(closing, p1 + cases[0][1], len(p1), anchor, info) == closing
    # and the anchor's own results stand under text (test_anchor_* above)
    assert propose(heads[0], p1 + cases[0][1], len(p1), TEXT, info) == _tids("vin", " k", "lein")
    assert propose(heads[3], p1 + cases[1][1], len(p1), TEXT, info) == _tids(" only", "\n", '":')


class _Tok:
    """A tokenizer as ``TokenInfo.from_tokenizer`` reads one (the hand-made vocabulary)."""

    all_special_ids = [0]

    def __len__(self):
        return len(_TTEXTS)

    def decode(self, ids):
        return "".join(_TTEXTS[i] for i in ids)

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return _tencode(text)


def test_text_in_the_runner_with_token_info_from_the_tokenizer():
    torch = pytest.importorskip("torch")
    info = TokenInfo.from_tokenizer(_Tok())
    assert info.texts[0] == "\x00" and info.encode("et,") == _tids("et", ",")
    prompt = _tids("<s>", " brown", " jacket", ",", " size", " M", "\n")
    row = prompt + _tids('{"', "keywords", '":', ' ["')
    batch = _Batch([row], [len(row)], [len(prompt)], vocab_size=len(_TTEXTS))
    runner = _Runner(batch, [False])
    heads = torch.tensor([_tids("xx", '"],', "keywords")], dtype=torch.int32)
    sampled = torch.tensor([[_TID["jack"], -1, -1, -1]])               # this step accepted "jack"
    out = hybrid_drafts(runner, heads, sampled, TEXT, info)
    assert out.tolist() == [_tids("et", '"],', "keywords")]


# --- the head's gate: the head's own probability decides where a copy first differs from it -----------

def test_the_gate_keeps_the_heads_draft_where_the_head_is_sure_and_the_copy_where_it_is_not():
    from cartspec.drafting import gate

    head, copy = [7, 8, 9], [7, 5, 6]  # the copy first differs at position 1
    assert gate(copy, head, [0.99, 0.95, 0.5], 0.9) == head       # the head is sure there: its draft stands
    assert gate(copy, head, [0.99, 0.6, 0.99], 0.9) == copy       # unsure there: the copy stands, whole
    assert gate([7, 5, 9], head, [0.2, 0.2, 0.99], 0.9) == [7, 5, 9]  # only the first difference is judged
    assert gate(copy, head, None, 0.9) == copy                    # no probabilities (not recorded): no gate
    assert gate(copy, head, {1: 0.95}, 0.9) == head               # a mapping of the positions where it is known
    assert gate(copy, head, {2: 0.95}, 0.9) == copy               # ... not known at the first difference: no gate
    assert gate(copy, head, [1.0, 1.0, 1.0], 0.0) == copy         # head_p 0: off
    assert gate(head, head, [0.1, 0.1, 0.1], 0.9) == head
    # through propose: a lookup match overrides the head where the head is unsure, not where it is sure
    prompt, reply = [1, 50, 60, 70, 80, 2], [9, 9, 60, 70]
    cfg = HybridConfig(n_min=2, n_max=4, rule="lookup", head_p=0.9)
    assert propose([81, 3, 4], prompt + reply, len(prompt), cfg, conf=[0.3, 0.9, 0.9]) == [80, 2, 4]
    assert propose([81, 3, 4], prompt + reply, len(prompt), cfg, conf=[0.97, 0.9, 0.9]) == [81, 3, 4]


def test_head_p_defaults_per_rule_round_trips_and_is_checked():
    from cartspec.drafting import HEAD_P
    from cartspec.serving.spec import Speculative

    assert HybridConfig(rule="pointer").head_p == HEAD_P["pointer"] > 0
    assert HybridConfig(rule="text").head_p == 0.0  # the other rules keep the drafts they were measured with
    assert HybridConfig(rule="pointer", head_p=0.0).head_p == 0.0
    cfg = HybridConfig(rule="text", head_p=0.8)
    assert HybridConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="head_p"):
        HybridConfig(head_p=1.5)
    sp = Speculative(method="hybrid", model="domain", num_speculative_tokens=3,
                     hybrid={"rule": "text", "head_p": 0.8})
    assert sp.hybrid_config().head_p == 0.8
    assert HybridConfig.from_dict(sp.additional_config()[KEY]).head_p == 0.8
    with pytest.raises(ValueError, match="setting of method 'hybrid'"):
        Speculative(method="eagle3", model="domain", num_speculative_tokens=3, hybrid={"head_p": 0.5})


def test_the_drafter_keeps_its_hidden_states_and_the_gate_asks_for_just_the_probabilities_it_needs():
    torch = pytest.importorskip("torch")
    from cartspec.vllm_plugin.hybrid import head_probs, record_hidden

    class Model:
        def compute_logits(self, h):
            return h  # the "hidden states" are the logits here

    class Drafter:
        model = Model()

        def _greedy_sample(self, h):
            return h.argmax(dim=-1)  # vLLM's own choice, left untouched

    d = Drafter()
    hidden = record_hidden(d)
    assert record_hidden(d) is hidden  # wrapped once
    step0 = torch.tensor([[0.0, 5.0, 0.0], [1.0, 1.0, 3.0]])
    step1 = torch.tensor([[9.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert d._greedy_sample(step0).tolist() == [1, 2]
    assert d._greedy_sample(step1).tolist() == [0, 0]
    step0[0, 1] = -5.0  # vLLM may reuse its buffers: what was recorded is a copy
    p = head_probs(d, hidden, [(0, 0), (1, 1), (1, 7)])
    assert set(p) == {(0, 0), (1, 1)}  # a position never drafted is left out (no gate there)
    assert p[(0, 0)] == pytest.approx(float(torch.softmax(torch.tensor([0.0, 5.0, 0.0]), -1).max()))
    assert p[(1, 1)] == pytest.approx(1 / 3)
    hidden.clear()
    assert head_probs(d, hidden, [(0, 0)]) == {}
    assert record_hidden(None) is None


def test_the_gate_reads_the_probabilities_recorded_while_the_head_drafted():
    torch = pytest.importorskip("torch")
    from cartspec.vllm_plugin.hybrid import recorded_probs

    def logits(*top):  # rows over a 4-token vocabulary whose softmax puts each ``p`` (> 1/2) on token 0
        return torch.log(torch.tensor([[p] + [(1 - p) / 3] * 3 for p in top]))

    recorded = [logits(0.9, 0.6), logits(0.5, 0.7)]  # per draft position: [requests, vocabulary]
    recorded[1][1] = torch.log(torch.tensor([0.7, 0.0, 0.2, 0.1]))  # -inf (outside the draft vocabulary) too
    assert recorded_probs(recorded, [(0, 0), (1, 1), (1, 5), (4, 0)]) == {
        (0, 0): pytest.approx(0.9), (1, 1): pytest.approx(0.7)}  # positions or requests never drafted: no gate
    assert recorded_probs([], [(0, 0)]) == {}


def test_runner_drafts_pass_each_requests_probabilities_to_the_gate():
    torch = pytest.importorskip("torch")
    batch = _Batch([[1, 50, 60, 70, 80, 2, 9], [1, 50, 60, 70, 80, 2, 9]], [7, 7], [6, 6])
    runner = _Runner(batch, [False, False])
    heads = torch.tensor([[11, 12, 13], [11, 12, 13]], dtype=torch.int32)
    sampled = torch.tensor([[60, 70, -1, -1], [60, 70, -1, -1]])
    asked = []

    def probs(pairs):  # request 0's head is sure of its first token, request 1's is not
        asked.append(list(pairs))
        return {(i, j): 0.95 if i == 0 else 0.5 for i, j in pairs}

    out = hybrid_drafts(runner, heads, sampled, HybridConfig(2, 4, "lookup", "prompt", head_p=0.9), probs=probs)
    assert out.tolist() == [[11, 12, 13], [80, 2, 13]]
    assert asked == [[(0, 0), (1, 0)]]  # once per step, each request's first difference only
    # no copy anywhere: nothing is asked
    asked.clear()
    hybrid_drafts(runner, torch.tensor([[80, 2, 13], [80, 2, 13]]), sampled,
                  HybridConfig(2, 4, "lookup", "prompt", head_p=0.9), probs=probs)
    assert asked == []


def test_serve_study_and_draft_acceptance_resolve_one_default_rule(tiny_llama_dir, tmp_path):
    """What a user measures is what they deploy: the hybrid's rule where none is given is the same in
    ``serve`` (its default deployment), the study (``hybrid:HEAD:γ``) and ``draft acceptance --method hybrid``."""
    from cartspec.agent.defaults import default_spec
    from cartspec.bench.plan import parse_deployment
    from cartspec.draft.pipeline import hybrid_config
    from cartspec.drafting import DEFAULT
    from cartspec.model.registry import resolve_model

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    bundled = resolve_model("commerce")
    served = default_spec("commerce", str(head), 3, enforce_eager=False).speculative.hybrid_config(str(bundled))
    studied = parse_deployment("hybrid:domain:3", "commerce").speculative.hybrid_config(str(bundled))
    measured = hybrid_config(target="commerce")
    assert served == studied == measured and measured.rule == DEFAULT.rule == "pointer"
    # a target no pointer was trained for: the hybrid drafts as the head alone, everywhere
    studied = parse_deployment("hybrid:domain:3", str(tiny_llama_dir)).speculative.hybrid_config(str(tiny_llama_dir))
    assert studied.rule == hybrid_config(target=str(tiny_llama_dir)).rule == "head"
    assert default_spec(str(tiny_llama_dir), str(head), 3, enforce_eager=False,
                        say=lambda m: None).speculative.method == "eagle3"
