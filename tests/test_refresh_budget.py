"""How long ``cartspec draft refresh`` trains: the step budget, early stopping on held-out τ (on scripted τ
curves, then in ``train_head`` with a scripted score), and a tiny refresh that records its τ curve."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cartspec.draft.budget import (BUDGET_CAP, BUDGET_FLOOR, MIN_EVAL_EVERY, EarlyStop, default_budget,
                                   default_eval_every)


def run(curve: list[float], every: int = 10, **settings) -> tuple[EarlyStop, int | None]:
    """Feed ``curve`` (τ at steps 0, every, 2*every, ...) until the rule says stop; (the rule, the stop step)."""
    stop = EarlyStop(**settings)
    for i, tau in enumerate(curve):
        stop.update(i * every, tau)
        if stop.should_stop:
            return stop, i * every
    return stop, None


# --- the stopping rule ---------------------------------------------------------------------------------------

def test_a_curve_that_rises_then_plateaus_stops_after_patience_and_keeps_the_best():
    curve = [1.50, 2.00, 2.40, 2.60, 2.58, 2.605, 2.59, 2.70]
    stop, at = run(curve, patience=3, min_delta=0.01)
    # 2.60 at step 30 is the last gain above 0.01; steps 40, 50, 60 bring none: stop at 60, never see 2.70
    assert at == 60
    assert (stop.best_step, stop.best_tau) == (50, 2.605)  # the highest τ seen, a gain too small to wait for
    assert stop.curve == [(i * 10, t) for i, t in enumerate(curve[:7])]
    assert "did not improve by more than 0.01 for 3 evaluations" in stop.reason() and "step 50" in stop.reason()


def test_a_curve_that_keeps_rising_runs_the_whole_budget():
    curve = [1.0 + 0.05 * i for i in range(30)]
    stop, at = run(curve, patience=2, min_delta=0.01)
    assert at is None and stop.best_step == 290 and stop.best_tau == pytest.approx(2.45)


def test_a_noisy_dip_within_patience_does_not_stop():
    curve = [1.5, 2.0, 1.7, 1.9, 2.3, 2.1, 2.2, 2.5, 2.6]
    stop, at = run(curve, patience=3, min_delta=0.01)
    assert at is None and stop.best_step == 80 and stop.best_tau == 2.6
    # the same dip one evaluation longer than the patience stops, keeping the τ before it
    stop, at = run([1.5, 2.0, 1.7, 1.9, 1.95, 2.5], patience=3, min_delta=0.01)
    assert at == 40 and (stop.best_step, stop.best_tau) == (10, 2.0)


def test_the_warm_up_does_not_count_and_patience_zero_never_stops():
    # a warm start shaken by the first steps: below its starting τ until step 20, the end of the warm-up
    stop, at = run([2.8, 2.5, 2.6, 2.7, 2.9, 3.0], every=10, patience=2, min_delta=0.01, min_steps=20)
    assert at is None and stop.best_step == 50
    stop, at = run([2.8, 2.5, 2.6, 2.7, 2.9], every=10, patience=2, min_delta=0.01, min_steps=0)
    assert at == 20 and stop.best_step == 0  # without it, the warm-up would end the run on the parent
    stop, at = run([2.0] + [1.0] * 20, patience=0)
    assert at is None and stop.best_step == 0


def test_a_resumed_rule_is_the_one_that_saw_the_curve():
    curve = [(0, 1.5), (10, 2.0), (20, 1.9), (30, 1.95)]
    live = EarlyStop(patience=3, min_delta=0.01)
    for s, t in curve:
        live.update(s, t)
    again = EarlyStop.replay([list(c) for c in curve], patience=3, min_delta=0.01)  # as state.json holds it
    assert again == live and again.waited == 2
    with pytest.raises(ValueError, match="step order"):
        again.update(30, 2.0)


def test_the_rule_imports_neither_torch_nor_an_engine():
    code = "import sys, cartspec.draft.budget; print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- the default budget --------------------------------------------------------------------------------------

def test_the_default_budget_grows_with_the_records_and_is_capped():
    budgets = [default_budget(n) for n in range(0, 6000, 7)]
    assert all(a <= b for a, b in zip(budgets, budgets[1:]))  # monotone
    assert min(budgets) == BUDGET_FLOOR and max(budgets) == BUDGET_CAP
    assert default_budget(240) == BUDGET_FLOOR > 22  # the 22 steps two epochs of 240 requests gave
    assert BUDGET_FLOOR < default_budget(800) < default_budget(1200) < BUDGET_CAP
    assert default_budget(3000) == default_budget(100_000) == BUDGET_CAP
    assert default_budget(800, "fresh") == 2 * default_budget(800)
    assert [default_eval_every(b) for b in (8, 100, 600)] == [MIN_EVAL_EVERY, 10, 60]
    with pytest.raises(ValueError):
        default_budget(-1)


# --- train_head with a scripted score ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_feature_dir(tiny_llama_dir, tmp_path_factory):
    from cartspec.draft.features import aux_layer_ids_for, extract

    recs = [{"prompt_ids": [1, 5, 9, 30 + i], "output_ids": [700 + i, 701, 702, 703, 2]} for i in range(4)]
    d = tmp_path_factory.mktemp("budget-features")
    extract(tiny_llama_dir, recs, d, aux_layer_ids_for(tiny_llama_dir))
    return d


@pytest.fixture
def tiny_features(tiny_feature_dir):
    from cartspec.draft.features import FeatureSet

    return FeatureSet.load(sorted(tiny_feature_dir.glob("shard-*.safetensors")))


class Scripted:
    """An ``evaluate`` that returns the next scripted score and keeps a copy of each head it was shown."""

    def __init__(self, scores: list[float]):
        self.scores, self.heads = list(scores), []

    def __call__(self, head, embed) -> float:
        assert not head.training and embed.dtype == torch.float32 and embed.device.type == "cpu"
        self.heads.append({k: v.clone() for k, v in head.state_dict().items()})
        return self.scores.pop(0)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_training_stops_on_a_plateau_and_returns_the_best_head(tmp_path, tiny_llama_dir, tiny_features):
    from cartspec.draft.train import TrainConfig, train_head

    cfg = TrainConfig(steps=20, batch_tokens=64, warmup_steps=2, eval_every=2, patience=2, min_delta=0.01)
    score = Scripted([1.0, 1.5, 2.0, 1.9, 1.95, 9.9])
    head, summary = train_head(tiny_features, tiny_llama_dir, tmp_path / "run", cfg, log=lambda m: None,
                               evaluate=score)
    assert summary["evals"] == [[0, 1.0], [2, 1.5], [4, 2.0], [6, 1.9], [8, 1.95]]  # stopped before 9.9
    assert summary["steps"] == 8 and summary["total_steps"] == 20 and summary["stopped_early"]
    assert "did not improve" in summary["stop_reason"]
    assert summary["best_step"] == 4 and summary["best_score"] == 2.0 and summary["kept"] == "best"
    assert same(head.state_dict(), score.heads[2]) and not same(score.heads[2], score.heads[4])
    # the same run again: it stays stopped and returns the same best head, from the checkpoint
    head2, again = train_head(tiny_features, tiny_llama_dir, tmp_path / "run", cfg, log=lambda m: None,
                              evaluate=Scripted([]))
    assert again["steps"] == 8 and again["stopped_early"] and again["best_step"] == 4
    assert same(head2.state_dict(), score.heads[2])
    assert [p.name for p in (tmp_path / "run" / "checkpoint").glob("best-*.pt")] == ["best-4.pt"]


def test_a_rising_score_runs_the_budget_and_keeps_the_last(tmp_path, tiny_llama_dir, tiny_features):
    from cartspec.draft.train import TrainConfig, train_head

    cfg = TrainConfig(steps=5, batch_tokens=64, warmup_steps=0, eval_every=2, patience=1)
    score = Scripted([1.0, 1.2, 1.4, 1.6])
    head, summary = train_head(tiny_features, tiny_llama_dir, tmp_path / "run", cfg, log=lambda m: None,
                               evaluate=score)
    assert [s for s, _ in summary["evals"]] == [0, 2, 4, 5]  # and at the last step
    assert summary["steps"] == 5 and not summary["stopped_early"] and summary["stop_reason"] is None
    assert summary["best_step"] == 5 and same(head.state_dict(), score.heads[-1])


# --- a tiny refresh ------------------------------------------------------------------------------------------

def test_a_refresh_records_its_tau_curve_and_widens_by_every_reply_token(tmp_path, tiny_llama_dir, monkeypatch):
    from test_refresh import FakeVLLM, make_parent, standard_traffic
    from typer.testing import CliRunner

    from cartspec.cli import app
    from cartspec.draft import features
    from cartspec.model.heads import HeadRegistry

    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(features, "vllm_generate", FakeVLLM([1, 2, 3, 4, 5, 6, 2]))
    parent = make_parent(tiny_llama_dir, tmp_path / "parent")
    traffic = standard_traffic(tmp_path / "t")
    r = CliRunner().invoke(app, ["draft", "refresh", "--traffic", str(traffic), "--head", "shop", "--from",
                                 str(parent), "--steps", "6", "--eval-every", "2", "--batch-tokens", "1024",
                                 "--device", "cpu", "--no-pointer"])
    assert r.exit_code == 0, r.output
    p = HeadRegistry("shop").get("v0002").provenance
    t, v = p["training"], p["vocab"]
    assert t["budget"] == 6 and t["budget_rule"] == "--steps" and t["steps"] <= 6
    assert [s for s, _ in t["tau_curve"]][:2] == [0, 2] and t["tau_curve"][-1][0] == t["steps"]
    assert all(tau >= 1.0 for _, tau in t["tau_curve"])
    best_step, best_tau = max(t["tau_curve"], key=lambda c: (c[1], -c[0]))
    assert (t["best_step"], t["best_tau"]) == (best_step, best_tau) and t["kept"] == "best"
    assert isinstance(t["stopped_early"], bool) and t["stop_reason"]
    assert t["eval"] == {"gamma": 3, "records": 8, "every": 2, "patience": 3, "min_delta": 0.01}
    # every training reply token is drafted now, the shopper's own words and prices seen once included
    assert v["min_count"] == 1 and v["train_outside_parent"] > 0 and v["train_outside_new"] == 0
    n = v["held_out_reply_tokens"]
    before = f"{100 * (n - v['held_out_outside_parent']) / n:.1f}%"
    after = f"{100 * (n - v['held_out_outside_new']) / n:.1f}%"
    assert f"held-out reply tokens inside the draft vocabulary: {before} -> {after} of {n}" in r.output
    assert f"best {best_tau:.3f} at step {best_step}" in r.output
    prov = (HeadRegistry("shop").get("v0002").path / "PROVENANCE.md").read_text()
    assert f"head kept: the best, step {best_step}" in prov
    log = json.loads((HeadRegistry("shop").get("v0002").path / "training_log.json").read_text())
    assert log["summary"]["evals"] == t["tau_curve"]


def test_the_default_budget_and_no_held_out_evaluation(tmp_path, tiny_llama_dir, monkeypatch):
    """Without --steps the budget follows the records; --eval-every 0 trains it all and keeps the last."""
    from test_refresh import FakeVLLM, make_parent, standard_traffic

    from cartspec.draft import budget, features
    from cartspec.draft.refresh import RefreshConfig, refresh_head

    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(features, "vllm_generate", FakeVLLM([1, 2, 3, 4, 5, 6, 2]))
    monkeypatch.setattr(budget, "BUDGET_FLOOR", 3)  # a quick default budget: 32 records -> 8 steps
    cfg = RefreshConfig(traffic=standard_traffic(tmp_path / "t"), head="shop", device="cpu", batch_tokens=1024,
                        from_head=str(make_parent(tiny_llama_dir, tmp_path / "parent")), eval_every=0, pointer=False)
    t = refresh_head(cfg).provenance["training"]
    assert t["budget"] == 8 == t["steps"] and t["budget_rule"] == "default for 32 training records"
    assert t["eval"] is None and t["tau_curve"] == [] and t["kept"] == "last" and not t["stopped_early"]
    assert "--eval-every 0" in t["stop_reason"]


# --- under torchrun ------------------------------------------------------------------------------------------

SCRIPT = """
import json, sys
from pathlib import Path
import torch
from cartspec.draft.features import FeatureSet
from cartspec.draft.train import TrainConfig, distributed, train_head
fs = FeatureSet.load(sorted(Path(sys.argv[1]).glob("shard-*.safetensors")))
scores, seen = [1.0, 1.5, 2.0, 1.9, 1.95, 9.9], []
def evaluate(head, embed):
    seen.append({k: v.clone() for k, v in head.state_dict().items()})
    return scores[len(seen) - 1]
cfg = TrainConfig(ttt_steps=2, batch_tokens=256, steps=30, warmup_steps=2, draft_vocab_size=512, save_every=1000,
                  threads=1, fsdp=sys.argv[4] == "fsdp", eval_every=2, patience=2)
head, summary = train_head(fs, Path(sys.argv[2]), Path(sys.argv[3]), cfg, log=lambda *a: None, evaluate=evaluate)
rank, world = distributed()
assert rank == 0 or seen == [], "only rank 0 evaluates"
if rank == 0:
    sd = head.state_dict()
    print("RESULT " + json.dumps({"world": world, "steps": summary["steps"], "best": summary["best_step"],
                                  "same_as_best": all(torch.equal(sd[k], seen[2][k]) for k in sd)}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_every_rank_stops_at_rank_0s_plateau_and_rank_0_keeps_the_best(mode, tiny_llama_dir, tiny_feature_dir,
                                                                       tmp_path):
    import os
    from pathlib import Path

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CARTSPEC_DDP_BACKEND": "gloo"}
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(script), str(tiny_feature_dir),
                           str(tiny_llama_dir), str(tmp_path / "out"), mode], env=env, capture_output=True,
                          text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    assert json.loads(line[len("RESULT "):]) == {"world": 2, "steps": 8, "best": 4, "same_as_best": True}
