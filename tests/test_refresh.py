"""``cartspec draft refresh``: a new head version from recorded traffic, on the tiny random Llama (no vLLM:
the regeneration of sampled replies is replaced by a stand-in that records what it was asked)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from cartspec.draft.refresh import (RefreshConfig, RefreshError, load_traffic, refresh_head, render_prompt,
                                    reply_ids, split_recent, traffic_records)
from cartspec.task.traffic import TrafficRecord

WORDS = ["walnut", "saddle", "teapot", "lantern", "marble", "violet", "copper", "harbor", "quilt", "meadow"]


def record(i: int, ts: float, *, query: str | None = None, temperature: float = 0.0, reply: str | None = None,
           **kw) -> TrafficRecord:
    q = query or f"{WORDS[i % len(WORDS)]} {WORDS[(3 * i + 1) % len(WORDS)]} under {10 + i} euros"
    msgs = [{"role": "system", "content": "Extract the shopper's product search parameters as one JSON object."},
            {"role": "user", "content": q}]
    return TrafficRecord(id=f"r{i}", ts=ts, task="search", query=q, messages=msgs,
                         reply=reply or json.dumps({"query": q.split(" under")[0], "max_price": 10 + i}),
                         temperature=temperature, structured=True, **kw)


def write_traffic(d: Path, recs: list[TrafficRecord], name: str = "traffic-20261202T000000-1.jsonl") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text("".join(r.model_dump_json() + "\n" for r in recs))
    return d


def standard_traffic(d: Path, n: int = 40) -> Path:
    """``n`` requests a second apart, every fifth sampled at T=0.7, plus an earlier duplicate of two of them."""
    recs = [record(i, 1000.0 + i, temperature=0.7 if i % 5 == 4 else 0.0) for i in range(n)]
    recs += [record(i, 900.0 + i, reply="an older answer") for i in (3, 35)]  # superseded by the later ones
    return write_traffic(d, recs)


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("CARTSPEC_HOME", str(h))
    return h


class FakeVLLM:
    """Stands in for ``features.vllm_generate``: answers every prompt with a fixed greedy reply."""

    def __init__(self, reply: list[int]):
        self.reply = reply
        self.calls: list[dict] = []

    def __call__(self, model_dir, prompts, sampling, out, **kw):
        self.calls.append({"prompts": [list(p) for p in prompts], "sampling": list(sampling), "out": out})
        return [{"i": i, "prompt_ids": list(p), "output_ids": list(self.reply), "finish_reason": "stop"}
                for i, p in enumerate(prompts)]


@pytest.fixture
def fake_vllm(monkeypatch):
    from cartspec.draft import features

    fake = FakeVLLM([1, 2, 3, 4, 5, 6, 2])
    monkeypatch.setattr(features, "vllm_generate", fake)
    return fake


def make_parent(target_dir: Path, out: Path, vocab: int = 256, digest: str | None = None) -> Path:
    """A random head for ``target_dir`` over target ids 0..vocab-1, pinned to it (or to ``digest``)."""
    from cartspec.draft.export import export_head
    from cartspec.draft.head import Eagle3Head, HeadConfig
    from cartspec.model.registry import target_digest

    cfg = HeadConfig.for_target(json.loads((target_dir / "config.json").read_text()), draft_vocab_size=vocab)
    torch.manual_seed(1)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(std=0.05)
    head.set_vocab(torch.arange(vocab))
    return export_head(head, out, target={"digest": digest or target_digest(target_dir), "name": str(target_dir)})


# --- the traffic ----------------------------------------------------------------------------------------------

def test_dedupe_keeps_the_latest_and_the_most_recent_share_is_held_out(tmp_path):
    split = load_traffic(standard_traffic(tmp_path / "t"), 0.2)
    assert split.read == 42 and split.after_dedupe == 40
    assert len(split.held_out) == 8 and len(split.train) == 32
    assert [r.id for r in split.held_out] == [f"r{i}" for i in range(32, 40)]  # the most recent 20%
    assert max(r.ts for r in split.train) < min(r.ts for r in split.held_out)
    r3 = next(r for r in split.train if r.id == "r3")
    assert r3.ts == 1003.0 and r3.reply != "an older answer"  # the duplicate's latest record
    w = split.windows(0.2)
    assert w["data_window"]["until"] == 1031.0 and w["held_out"]["since"] == 1032.0
    assert w["held_out"]["until"] == 1039.0
    assert w["records"] == {"read": 42, "first_ts": 900.0 + 3, "last_ts": 1039.0, "after_dedupe": 40, "train": 32,
                            "held_out": 8}
    # a training record at the boundary's time goes to the held-out side: no training record in its window
    recs = [record(i, 1000.0 + min(i, 7)) for i in range(10)]
    train, held = split_recent(recs, 0.2)
    assert all(r.ts < held[0].ts for r in train) and len(held) == 3


def test_refusals_say_what_to_do(tmp_path, home):
    with pytest.raises(RefreshError, match="record-traffic"):
        load_traffic(tmp_path / "nowhere", 0.2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RefreshError, match="no traffic files"):
        load_traffic(tmp_path / "empty", 0.2)
    few = write_traffic(tmp_path / "few", [record(i, 1000.0 + i) for i in range(12)] +
                        [record(1, 2000.0), record(2, 2001.0)])  # 12 distinct requests
    with pytest.raises(RefreshError, match="12 distinct requests.*at least 20"):
        load_traffic(few, 0.2)
    traffic = standard_traffic(tmp_path / "t")
    with pytest.raises(RefreshError, match="--from domain"):
        refresh_head(RefreshConfig(traffic=traffic, head="shop", device="cpu"))
    with pytest.raises(RefreshError, match="--init current"):
        refresh_head(RefreshConfig(traffic=traffic, head="shop", init="fresh", widen=10, device="cpu"))
    with pytest.raises(ValueError):
        RefreshConfig(traffic=traffic, head="shop", held_out=1.0)


def test_a_head_or_traffic_pinned_to_another_target_is_refused(tmp_path, home, tiny_llama_dir, fake_vllm):
    from cartspec.model.heads import HeadRegistry

    other = make_parent(tiny_llama_dir, tmp_path / "other-head", digest="0123456789abcdef")
    traffic = standard_traffic(tmp_path / "t")
    with pytest.raises(RefreshError, match="another target"):
        refresh_head(RefreshConfig(traffic=traffic, head="pinned", from_head=str(other), target=str(tiny_llama_dir),
                                   device="cpu", steps=1))
    # traffic served by a version of this registry that was pinned to another target: its replies are not ours
    reg = HeadRegistry("served")
    reg.add(make_parent(tiny_llama_dir, tmp_path / "ours"))
    reg.add(other, force=True)  # v0002, pinned elsewhere
    recs = [record(i, 1000.0 + i, head="served", head_version="v0002") for i in range(30)]
    traffic2 = write_traffic(tmp_path / "t2", recs)
    with pytest.raises(RefreshError, match="served@v0002 pinned to another target"):
        refresh_head(RefreshConfig(traffic=traffic2, head="served", device="cpu", steps=1))
    # a fine-tune of the registry's target (a merged model): its base's head drafts for it, but the registry
    # keeps one target per name
    import shutil

    from cartspec.draft.refresh import adapter_digest_of

    ft = tmp_path / "fine-tune"
    shutil.copytree(tiny_llama_dir, ft)
    (ft / "cartspec.json").write_text(json.dumps({"stage": "merge", "base": str(tiny_llama_dir),
                                                  "adapter_digest": "abcdef123456"}))
    assert adapter_digest_of(ft) == "abcdef123456" and adapter_digest_of(tiny_llama_dir) is None
    with pytest.raises(RefreshError, match="pinned to another target than its registry"):
        refresh_head(RefreshConfig(traffic=traffic, head="served", target=str(ft), device="cpu", steps=1))
    assert fake_vllm.calls == []  # refused before anything slow


# --- replies as they are, sampled ones regenerated -------------------------------------------------------------

def test_greedy_replies_are_used_as_written_and_sampled_ones_regenerated(tmp_path, home, tiny_llama_dir, fake_vllm):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    recs = [record(0, 1.0), record(1, 2.0, temperature=0.7), record(2, 3.0)]
    cut = record(3, 4.0, reply='{"query": "walnut')
    cut = cut.model_copy(update={"output_tokens": len(tok(cut.reply, add_special_tokens=False).input_ids)})
    out, counts = traffic_records(tiny_llama_dir, tok, recs + [cut], "sampled", max_tokens=64)
    assert counts == {"as_is": 3, "regenerated": 1}
    text = tok.apply_chat_template(recs[0].messages, tokenize=False, add_generation_prompt=True)
    assert out[0]["prompt_ids"] == tok(text, add_special_tokens=False).input_ids == render_prompt(tok, recs[0].messages)
    assert tok.decode(out[0]["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert out[0]["output_ids"] == tok(recs[0].reply, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert out[3]["output_ids"][-1] != tok.eos_token_id  # cut at the token cap: no EOS was written
    assert reply_ids(tok, cut, tok.eos_token_id) == out[3]["output_ids"]
    (call,) = fake_vllm.calls
    assert call["prompts"] == [out[1]["prompt_ids"]] and call["sampling"][0].temperature == 0.0
    assert out[1]["output_ids"] == fake_vllm.reply
    out_all, counts_all = traffic_records(tiny_llama_dir, tok, recs, "all", max_tokens=64)
    assert counts_all == {"as_is": 0, "regenerated": 3} and len(fake_vllm.calls[-1]["prompts"]) == 3


# --- warm start and a wider vocabulary ---------------------------------------------------------------------------

def test_widen_vocab_adds_the_missing_reply_tokens():
    from cartspec.draft.train import widen_vocab

    counts = Counter({5: 9, 300: 7, 301: 2, 302: 1, 400: 3})
    ids, added = widen_vocab(torch.arange(10), counts, vocab_size=1000)
    assert added == [300, 400, 301] and ids.tolist() == list(range(10)) + [300, 301, 400]  # seen twice or more
    assert widen_vocab(torch.arange(10), counts, 1000, widen=1)[1] == [300]
    assert widen_vocab(torch.arange(10), counts, 1000, widen=4)[1] == [300, 400, 301, 302]
    assert widen_vocab(torch.arange(10), counts, 1000, widen=0)[1] == []
    assert widen_vocab(torch.arange(10), counts, vocab_size=11)[1] == []  # never past the target's vocabulary
    assert widen_vocab(torch.arange(10), counts, vocab_size=12)[1] == []  # ids >= vocab_size are not tokens


def test_warm_start_is_the_parent_on_its_own_vocabulary(tmp_path, tiny_llama_dir):
    from cartspec.draft.export import load_head
    from cartspec.draft.features import aux_layer_ids_for
    from cartspec.draft.train import load_target_weights, warm_head

    parent_dir = make_parent(tiny_llama_dir, tmp_path / "parent", vocab=64)
    parent = load_head(parent_dir)
    tw = load_target_weights(tiny_llama_dir)
    new_ids = torch.tensor(list(range(64)) + [500, 1200])
    head = warm_head(parent_dir, new_ids, tw, json.loads((tiny_llama_dir / "config.json").read_text()),
                     aux_layer_ids_for(tiny_llama_dir))
    assert head.cfg.draft_vocab_size == 66 and head.draft_ids.tolist() == new_ids.tolist()
    assert bool(head.t2d[500]) and bool(head.t2d[1200]) and not bool(head.t2d[64])
    ps, hs = parent.state_dict(), head.state_dict()
    for k, v in ps.items():
        if k not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(hs[k], v), k
    assert torch.equal(hs["lm_head.weight"][:64], ps["lm_head.weight"])  # the old rows, kept
    assert torch.equal(hs["lm_head.weight"][64:], tw["lm_head"][[500, 1200]].float())  # the new: the target's rows
    with pytest.raises(ValueError, match="every draft token"):
        warm_head(parent_dir, torch.arange(1, 70), tw, json.loads((tiny_llama_dir / "config.json").read_text()),
                  aux_layer_ids_for(tiny_llama_dir))


def test_training_starts_from_the_parent(tmp_path, tiny_llama_dir):
    """``train_head`` with a warm start and no steps returns the parent's head on a widened vocabulary."""
    from cartspec.draft.export import load_head
    from cartspec.draft.features import FeatureSet, aux_layer_ids_for, extract
    from cartspec.draft.train import TrainConfig, WarmStart, train_head

    parent_dir = make_parent(tiny_llama_dir, tmp_path / "parent", vocab=64)
    recs = [{"prompt_ids": [1, 5, 9, 30], "output_ids": [700, 701, 702, 2]} for _ in range(2)]
    fs = FeatureSet.load(extract(tiny_llama_dir, recs, tmp_path / "f", aux_layer_ids_for(tiny_llama_dir)))
    ids = torch.tensor(list(range(64)) + [700, 701, 702])
    head, summary = train_head(fs, tiny_llama_dir, tmp_path / "run", TrainConfig(steps=0, batch_tokens=256),
                               warm=WarmStart(parent_dir, ids), log=lambda m: None)
    assert summary["init"] == "warm" and summary["draft_vocab_size"] == 67
    parent = load_head(parent_dir)
    assert torch.equal(head.state_dict()["fc.weight"], parent.state_dict()["fc.weight"])
    assert torch.equal(head.lm_head.weight[:64], parent.lm_head.weight)


# --- the whole refresh ----------------------------------------------------------------------------------------

def test_refresh_registers_a_candidate_with_its_provenance(tmp_path, home, tiny_llama_dir, fake_vllm):
    from cartspec.draft.export import load_head
    from cartspec.model.heads import HeadRegistry
    from cartspec.model.registry import target_digest

    parent_dir = make_parent(tiny_llama_dir, tmp_path / "parent")
    traffic = standard_traffic(tmp_path / "t")
    cfg = RefreshConfig(traffic=traffic, head="shop", from_head=str(parent_dir), device="cpu", steps=3,
                        batch_tokens=1024, save_every=100)
    lines: list[str] = []
    res = refresh_head(cfg, command="cartspec draft refresh --traffic T --head shop", log=lines.append)
    reg = HeadRegistry("shop")
    v1, v2 = reg.versions()
    assert v1.status == "current" and v1.provenance["seeded_from"] == str(parent_dir)
    assert res.ref == "shop@v0002" and v2.status == "candidate" and v2.parent == "v0001"
    assert v2.target_digest == target_digest(tiny_llama_dir)
    p = v2.provenance
    assert p["command"] == "cartspec draft refresh --traffic T --head shop" and p["init"] == "current"
    assert p["parent"] == "v0001" and p["target_digest"] == v2.target_digest and p["adapter_digest"] is None
    assert p["records"]["read"] == 42 and p["records"]["after_dedupe"] == 40 and p["records"]["train"] == 32
    assert p["data_window"]["until"] == 1031.0 and p["held_out"] == {"since": 1032.0, "until": 1039.0, "share": 0.2,
                                                                     "n": 8}
    assert p["replies"]["as_is"] == 26 and p["replies"]["regenerated"] == 6  # r4, r9, ..., r29 sampled
    # one vLLM run regenerates the sampled replies of both sides: 6 training ones, r34 and r39 held out
    assert len(fake_vllm.calls) == 1 and len(fake_vllm.calls[0]["prompts"]) == 8
    v = p["vocab"]
    assert v["parent_size"] == 256 and v["added"] > 0 and v["size"] == 256 + v["added"]
    assert v["train_outside_parent"] > 0 and v["train_outside_new"] < v["train_outside_parent"]
    assert v["held_out_outside_new"] <= v["held_out_outside_parent"]
    assert p["training"]["steps"] == 3 and set(p["seconds"]) >= {"read", "features", "train", "total"}
    head = load_head(v2.path)
    assert head.cfg.draft_vocab_size == v["size"] and bool(head.t2d[:256].all())
    prov = (v2.path / "PROVENANCE.md").read_text()
    assert "shop@v0002" in prov and "parent: shop@v0001" in prov and "held out" in prov
    assert (v2.path / "training_log.json").exists() and not (v2.path / "checkpoint").exists()
    assert any("registered shop@v0002" in ln for ln in lines)
    # the same command again: the version it registered, not a second copy
    again = refresh_head(cfg, log=lines.append)
    assert again.reused and again.ref == "shop@v0002" and len(reg.versions()) == 2


def test_fresh_refresh_picks_its_vocabulary_from_the_traffic(tmp_path, home, tiny_llama_dir, fake_vllm):
    from cartspec.model.heads import HeadRegistry

    reg = HeadRegistry("shop")
    reg.add(make_parent(tiny_llama_dir, tmp_path / "parent"))
    res = refresh_head(RefreshConfig(traffic=standard_traffic(tmp_path / "t"), head="shop", init="fresh",
                                     draft_vocab=300, device="cpu", steps=1, batch_tokens=1024))
    p = res.provenance
    assert p["init"] == "fresh" and p["vocab"]["size"] == 300 and p["vocab"]["train_outside_new"] == 0
    assert p["training"]["lr"] == 1e-3 and reg.get("v0002").status == "candidate"


def test_the_command_refuses_clearly_and_registers_a_candidate(tmp_path, home, tiny_llama_dir, fake_vllm):
    from typer.testing import CliRunner

    from cartspec.cli import app

    runner = CliRunner()
    traffic = standard_traffic(tmp_path / "t")
    r = runner.invoke(app, ["draft", "refresh", "--traffic", str(traffic), "--head", "shop"])
    assert r.exit_code == 2 and "--from domain" in r.output
    r = runner.invoke(app, ["draft", "refresh", "--traffic", str(traffic), "--head", "shop", "--init", "warm"])
    assert r.exit_code == 2 and "--init must be current or fresh" in r.output
    parent = make_parent(tiny_llama_dir, tmp_path / "parent")
    r = runner.invoke(app, ["draft", "refresh", "--traffic", str(traffic), "--head", "shop", "--from", str(parent),
                            "--steps", "1", "--batch-tokens", "1024", "--device", "cpu", "--widen", "5"])
    assert r.exit_code == 0, r.output
    assert "candidate shop@v0002" in r.output and "+5 draft tokens" in r.output
