"""A head records the target it was trained for; serve, study and draft acceptance refuse it on another."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cartspec.cli import app
from cartspec.draft.export import export_head
from cartspec.draft.head import Eagle3Head, HeadConfig
from cartspec.model.registry import (HEADS_DIR, HeadMismatch, check_head, head_target, matching_bundled_head,
                                     model_lineage, target_digest)


def _head(target_dir, out, digest=None):
    cfg = HeadConfig.for_target(json.loads((target_dir / "config.json").read_text()), draft_vocab_size=64)
    head = Eagle3Head(cfg)
    head.set_vocab(torch.arange(64))
    return export_head(head, out, target={"digest": digest or target_digest(target_dir), "name": str(target_dir)})


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory, tokenizer_dir):
    from conftest import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("other"), tokenizer_dir, seed=1)


def test_check_head(tiny_llama_dir, other_llama, tmp_path):
    head = _head(tiny_llama_dir, tmp_path / "h")
    assert head_target(head)["digest"] == target_digest(tiny_llama_dir)
    assert check_head(head, tiny_llama_dir) == "match"
    with pytest.raises(HeadMismatch, match="trained for another target.*--force"):
        check_head(head, other_llama)
    warned = []
    assert check_head(head, other_llama, force=True, warn=warned.append) == "forced"
    assert "WARNING (--force)" in warned[0]


def test_cli_refuses_a_head_for_another_target(tiny_llama_dir, other_llama, tmp_path):
    """Before starting anything: serve (head and --spec file), study, draft acceptance."""
    head = _head(tiny_llama_dir, tmp_path / "h")
    runner = CliRunner()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": str(other_llama), "speculative": {
        "method": "eagle3", "model": str(head), "num_speculative_tokens": 3}}))
    for args in (["serve", "--model", str(other_llama), "--head", str(head)],
                 ["serve", "--spec", str(spec)],
                 ["study", "--model", str(other_llama), "--deployments", f"eagle3:{head}:3", "--out",
                  str(tmp_path / "study")],
                 ["draft", "acceptance", "--head", str(head), "--target", str(other_llama), "--out",
                  str(tmp_path / "a.json")]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert "trained for another target" in " ".join(res.output.split()), res.output
    assert not (tmp_path / "study" / "results.jsonl").exists()


def test_bundled_heads_match_the_bundled_models():
    """Recorded without retraining: domain for the commerce model, generic for the base (and so for every
    fine-tune merged onto it, as the study serves it)."""
    from cartspec.model.registry import resolve_model

    commerce, base = resolve_model("commerce"), resolve_model("base")
    assert head_target(HEADS_DIR / "domain")["digest"] == target_digest(commerce)
    assert head_target(HEADS_DIR / "generic")["digest"] == target_digest(base)
    assert model_lineage(commerce)[1] == target_digest(base)
    assert check_head(HEADS_DIR / "generic", commerce) == "base"
    assert matching_bundled_head(commerce) == "domain"
    assert matching_bundled_head(base) == "generic"
    with pytest.raises(HeadMismatch):
        check_head(HEADS_DIR / "domain", base)


def test_head_auto_picks_no_bundled_head_for_a_users_model(tiny_llama_dir):
    """A user's model no bundled head was trained for is served with the schema drafter, which needs no head
    (and says so); ``--head none`` (the plain deployment) drafts nothing."""
    from cartspec.agent.defaults import default_spec

    assert matching_bundled_head(tiny_llama_dir) is None
    said = []
    sp = default_spec(str(tiny_llama_dir), "auto", 3, True, say=said.append).speculative
    assert (sp.method, sp.num_speculative_tokens, sp.model) == ("schema", 3, None)
    assert "schema drafter" in said[0] and "cartspec draft train" in said[0]
    assert default_spec(str(tiny_llama_dir), "none", 3, True).speculative.method == "none"
    assert default_spec("commerce", "auto", 3, True, draft="schema").speculative.method == "schema"
    assert default_spec("commerce", "auto", 3, True).speculative.model == "domain"
