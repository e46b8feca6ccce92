"""The draft pipeline as functions (``draft/pipeline.py``): typed configs in, refusals before the slow part."""

from __future__ import annotations

import pytest

from cartspec.draft.pipeline import (DraftPipelineError, HeadTrainingConfig, PointerTrainingConfig, build_head,
                                     build_pointer, hybrid_config)


def test_configs_round_trip_through_json(tmp_path):
    head = HeadTrainingConfig(kind="domain", prompts="64", steps=3, out=tmp_path / "h")
    assert HeadTrainingConfig.model_validate_json(head.model_dump_json()) == head
    assert head.label == "domain" and head.target_name == "commerce"
    assert HeadTrainingConfig(prompts="my.jsonl").label == "custom"
    assert HeadTrainingConfig(kind="generic").target_name == "base"
    pointer = PointerTrainingConfig(epochs=2)
    assert PointerTrainingConfig.model_validate_json(pointer.model_dump_json()) == pointer
    with pytest.raises(ValueError):
        HeadTrainingConfig(epoch=2)  # a misspelt setting is refused, not ignored


def test_build_head_refuses_before_anything_slow(tmp_path, monkeypatch):
    from cartspec.model import registry

    with pytest.raises(DraftPipelineError, match="--prompts FILE.jsonl"):
        build_head(HeadTrainingConfig(target="x"))
    with pytest.raises(DraftPipelineError, match="generic or domain"):
        build_head(HeadTrainingConfig(kind="other"))
    monkeypatch.setattr(registry, "resolve_model", lambda name: tmp_path)
    monkeypatch.setattr(registry, "target_digest", lambda d: "0123456789abcdef")
    with pytest.raises(DraftPipelineError, match="inside the bundled heads"):
        build_head(HeadTrainingConfig(kind="domain", out=registry.HEADS_DIR / "domain", device="cpu"))


def test_build_pointer_refuses_the_bundled_pointers(tmp_path, monkeypatch):
    from cartspec.model import registry

    monkeypatch.setattr(registry, "resolve_model", lambda name: tmp_path)
    monkeypatch.setattr(registry, "target_digest", lambda d: "0123456789abcdef")
    with pytest.raises(DraftPipelineError, match="inside the bundled pointers"):
        build_pointer(PointerTrainingConfig(out=registry.POINTERS_DIR / "commerce"))


def test_hybrid_config_from_acceptance_settings(tiny_llama_dir):
    from cartspec.drafting import DEFAULT

    # the default rule, as serve deploys it: the pointer for the bundled target, the head alone for a target
    # no pointer was trained for
    assert DEFAULT.rule == "pointer"
    assert hybrid_config(target="commerce").rule == "pointer" and hybrid_config(target="commerce").pointer
    assert hybrid_config(target=str(tiny_llama_dir)).rule == "head"
    assert hybrid_config(lookup_max=DEFAULT.n_max + 1).n_max == DEFAULT.n_max + 1
    with pytest.raises(DraftPipelineError, match="--rule pointer"):
        hybrid_config(rule="lookup", pointer="commerce")


def test_draft_pointer_trains_into_the_directory_it_names(tiny_llama_dir, tmp_path):
    """`cartspec draft pointer` end to end on a tiny target: options -> PointerTrainingConfig -> build_pointer."""
    import json

    from typer.testing import CliRunner

    from cartspec.cli import app
    from cartspec.model.registry import target_digest

    out = tmp_path / "ptr"
    res = CliRunner().invoke(app, ["draft", "pointer", "--target", str(tiny_llama_dir), "--prompts", "24",
                                   "--dev", "0", "--epochs", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "pointer" in res.output and str(out) in " ".join(res.output.split())
    conf = json.loads((out / "config.json").read_text())
    assert conf["cartspec"]["target"] == {"name": str(tiny_llama_dir), "digest": target_digest(tiny_llama_dir)}


def test_build_head_refuses_substituted_prompts_off_the_domain_and_a_head_of_another_target(tmp_path, monkeypatch):
    import json

    from cartspec.model import registry

    monkeypatch.setattr(registry, "resolve_model", lambda name: tmp_path)
    monkeypatch.setattr(registry, "target_digest", lambda d: "0123456789abcdef")
    with pytest.raises(DraftPipelineError, match="--kind domain"):
        build_head(HeadTrainingConfig(kind="generic", substituted=10, out=tmp_path / "h", device="cpu"))
    other = tmp_path / "other-head"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"cartspec": {"target": {"digest": "ffffffffffffffff"}}}))
    with pytest.raises(DraftPipelineError, match="target digest ffffffffffffffff"):
        build_head(HeadTrainingConfig(kind="domain", init=str(other), out=tmp_path / "h", device="cpu"))
    with pytest.raises(DraftPipelineError, match="--init .*not found"):
        build_head(HeadTrainingConfig(kind="domain", init=str(tmp_path / "nowhere"), out=tmp_path / "h",
                                      device="cpu"))


def test_substituted_prompts_are_a_feature_set_of_their_own(tiny_llama_dir, tmp_path, monkeypatch):
    """Adding --substituted keeps the plain prompts' features (same prompts, same sampling: the same cache
    key) and builds the substituted ones beside them; both feed the training."""
    from cartspec.draft import features
    from cartspec.model import registry

    monkeypatch.setattr(registry, "resolve_model", lambda name: tiny_llama_dir)
    calls: list[tuple[str, list, list]] = []

    class Stop(Exception):
        pass

    def fake_build(model_dir, prompts, sampling, tag="", **kw):
        calls.append((tag, [list(p) for p in prompts], [s.as_dict() for s in sampling]))
        raise Stop

    monkeypatch.setattr(features, "build_features", fake_build)
    with pytest.raises(Stop):
        build_head(HeadTrainingConfig(kind="domain", prompts="8", sampled=0.5, out=tmp_path / "a", device="cpu"))
    plain = calls.pop()

    def fake_two(model_dir, prompts, sampling, tag="", **kw):
        calls.append((tag, [list(p) for p in prompts], [s.as_dict() for s in sampling]))
        if len(calls) == 2:
            raise Stop
        return tmp_path, [], []

    monkeypatch.setattr(features, "build_features", fake_two)
    with pytest.raises(Stop):
        build_head(HeadTrainingConfig(kind="domain", prompts="8", sampled=0.5, substituted=6, out=tmp_path / "b",
                                      device="cpu"))
    assert calls[0] == plain and plain[0] == "domain"
    tag, prompts, sampling = calls[1]
    assert tag == "domain-substituted" and len(prompts) == 6 + 3
    assert [s["temperature"] for s in sampling].count(0.0) == 6
    seeds = {s.get("seed") for s in sampling} - {None}
    assert len(seeds) == 3 and not seeds & {s.get("seed") for s in plain[2]}


def test_a_warm_start_widens_the_head_vocabulary_by_the_reply_tokens_it_lacks(tmp_path):
    import torch

    from cartspec.draft.pipeline import _widened
    from cartspec.draft.train import WarmStart

    (tmp_path / "config.json").write_text('{"vocab_size": 100}')
    logs: list[str] = []
    warm = _widened(WarmStart(head_dir=tmp_path, draft_ids=torch.tensor([1, 2, 3])),
                    [{"output_ids": [3, 4, 4, 5]}, {"output_ids": [5, 7, 99, 150]}], tmp_path, logs.append)
    # 4 and 5 are seen twice; 7 and 99 once; 150 is outside the target's vocabulary
    assert warm.draft_ids.tolist() == [1, 2, 3, 4, 5] and warm.head_dir == tmp_path
    assert "3 + 2 reply tokens" in logs[0]
