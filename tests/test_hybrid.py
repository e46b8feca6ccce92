"""The hybrid drafter (EAGLE-3 + prompt lookup): its lookup, its combination rule, its settings."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from cartspec.serving.hybrid import (ENV, HybridConfig, TokenInfo, combine, context_for, hybrid_drafts, lookup,
                                     patch_runner, propose, value_start)


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


def test_combine_rules_per_position():
    assert combine([1, 2, 3], [7]) == [7, 2, 3]           # lookup covers position 0, head fills 1..2
    assert combine([1, 2, 3], [7, 8, 9, 10]) == [7, 8, 9]  # never more than γ
    assert combine([1, 2, 3], []) == [1, 2, 3]
    assert combine([1, 2, 3], [1, 8], "agree") == [1, 2, 3]  # agrees on the first token: the head's chain stays
    assert combine([1, 2, 3], [7, 8], "agree") == [7, 8, 3]
    assert combine([1, 2, 3], [7, 8], "head") == [1, 2, 3]
    with pytest.raises(ValueError, match="unknown hybrid rule"):
        combine([1], [2], "best")


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


def test_context_for_appends_this_steps_accepted_tokens():
    row = np.array([1, 2, 3, 0, 0])
    assert context_for(row, 3, [7, 8, -1, -1], vocab_size=100) == [1, 2, 3, 7, 8]
    assert context_for(row, 3, None, vocab_size=100) == [1, 2, 3]
    assert context_for(row, 2, [100], vocab_size=100) == [1, 2]  # out of vocabulary: a padding marker


def test_config_from_env_rejects_bad_settings():
    assert HybridConfig.from_env(HybridConfig(3, 5, "agree", "context").to_env()) == HybridConfig(3, 5, "agree", "context")
    with pytest.raises(ValueError, match="not JSON"):
        HybridConfig.from_env("rule=lookup")
    with pytest.raises(ValueError, match="must be an object"):
        HybridConfig.from_env(json.dumps({"rule": "lookup", "gamma": 3}))
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


def test_patch_runner_only_with_the_environment_variable(monkeypatch):
    import types

    calls = []

    class Runner:
        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *a, **kw):
            calls.append(1)
            return [[1, 2]]

    mod = types.ModuleType("fake_runner_module")
    mod.GPUModelRunner = Runner
    monkeypatch.delenv(ENV, raising=False)
    assert patch_runner(mod) is False
    monkeypatch.setenv(ENV, HybridConfig().to_env())
    assert patch_runner(mod) is True
    assert patch_runner(mod) is False  # once


def test_hybrid_spec_runs_eagle3_underneath_with_its_settings_in_the_environment():
    from cartspec.bench.plan import parse_deployment
    from cartspec.serving.spec import Speculative

    d = parse_deployment("hybrid:domain:3", "commerce")
    sp = d.speculative
    assert (sp.method, sp.model, sp.num_speculative_tokens) == ("hybrid", "domain", 3)
    assert d.label == "hybrid-domain-g3"
    assert sp.vllm_config("/heads/domain") == {"num_speculative_tokens": 3, "method": "eagle3",
                                                "model": "/heads/domain"}
    env = sp.server_env()
    assert HybridConfig.from_env(env[ENV]) == sp.hybrid_config()
    tuned = Speculative(method="hybrid", model="domain", num_speculative_tokens=5, prompt_lookup_min=3,
                        prompt_lookup_max=5, hybrid_rule="agree", lookup_scope="context")
    assert tuned.hybrid_config() == HybridConfig(3, 5, "agree", "context")
    assert Speculative(method="eagle3", model="domain", num_speculative_tokens=3).server_env() == {}
    with pytest.raises(ValueError, match="needs model"):
        Speculative(method="hybrid", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="settings of method 'hybrid'"):
        Speculative(method="eagle3", model="domain", num_speculative_tokens=3, hybrid_rule="agree")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        Speculative(method="hybrid", model="domain", num_speculative_tokens=3, prompt_lookup_min=5,
                    prompt_lookup_max=2)


def test_a_hybrid_setting_in_the_callers_environment_does_not_leak_into_other_servers(monkeypatch, tmp_path):
    from cartspec.serving import server as server_mod
    from cartspec.serving.spec import DeploymentSpec, Speculative

    seen = {}

    class Stop(Exception):
        pass

    def fake_popen(cmd, env=None, **kw):
        seen.update(env)
        raise Stop

    monkeypatch.setenv(ENV, HybridConfig().to_env())
    monkeypatch.setattr(server_mod.subprocess, "Popen", fake_popen)
    spec = DeploymentSpec(model=str(tmp_path), speculative=Speculative(method="ngram", num_speculative_tokens=3))
    srv = server_mod.VllmServer(spec, log_dir=tmp_path, model_dir=tmp_path)
    with pytest.raises(Stop):
        srv.start()
    assert ENV not in seen


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
    assert HybridConfig.from_env(ANCHOR.to_env()) == ANCHOR
