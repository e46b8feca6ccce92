"""One reader for request files: cartspec request lines and OpenAI chat lines, mixed in one file."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cartspec.task.data import DataFileError, read_requests
from cartspec.task.prompts import SYSTEM, messages


def _write(path, lines):
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_chat_lines_and_request_lines(tmp_path):
    f = _write(tmp_path / "r.jsonl", [
        {"query": "red shoes under 50", "gold": {"category": "shoes"}},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"},
                      {"role": "user", "content": [{"type": "text", "text": "wool "}, {"type": "text", "text": "hat"}]},
                      {"role": "assistant", "content": "the logged reply"}], "id": "c1"},
        {"messages": [{"role": "user", "content": "no system here"}]},
    ])
    a, b, c = read_requests(f)
    assert messages(a)[0] == {"role": "system", "content": SYSTEM["search"]} and a.gold
    assert messages(b) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"}, {"role": "user", "content": "wool hat"}]
    assert b.id == "c1" and b.meta["reference"] == "the logged reply" and b.gold is None
    assert messages(c) == [{"role": "user", "content": "no system here"}]  # sent as logged: no system prompt


@pytest.mark.parametrize("line,why", [
    ({"messages": [{"role": "tool", "content": "x"}, {"role": "user", "content": "q"}]}, "role 'tool'"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "must end with a user message"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user", "content": "q"}], "temperature": 0}, "unexpected keys"),
])
def test_bad_chat_lines_say_which_line_and_why(tmp_path, line, why):
    f = _write(tmp_path / "r.jsonl", [{"query": "ok"}, line])
    with pytest.raises(DataFileError, match=f"r.jsonl:2: .*{why}"):
        read_requests(f)


def test_draft_train_needs_prompts_and_never_writes_the_bundled_heads(tmp_path, monkeypatch):
    from cartspec.cli import app
    from cartspec.model import registry

    runner = CliRunner()
    res = runner.invoke(app, ["draft", "train", "--target", "x"])
    assert res.exit_code == 2 and "--prompts FILE.jsonl" in res.output
    monkeypatch.setattr(registry, "resolve_model", lambda name: tmp_path)
    monkeypatch.setattr(registry, "target_digest", lambda d: "0123456789abcdef")
    res = runner.invoke(app, ["draft", "train", "--kind", "domain", "--out", str(registry.HEADS_DIR / "domain")])
    assert res.exit_code == 2 and "inside the bundled heads" in " ".join(res.output.split())


def test_default_head_directory_is_not_the_bundled_one(monkeypatch, tmp_path):
    from cartspec.draft.pipeline import default_out, is_bundled

    monkeypatch.delenv("CARTSPEC_HOME", raising=False)
    assert str(default_out("custom", "0123456789abcdef")) == "runs/heads/custom-01234567"
    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path))
    assert default_out("domain", "0123456789abcdef") == tmp_path / "heads" / "domain-01234567"
    assert not is_bundled(default_out("domain", "0123456789abcdef"))


def test_draft_train_on_a_users_prompt_file(tiny_llama_dir, tmp_path, monkeypatch):
    """The whole `draft train --target DIR --prompts FILE.jsonl` path, with vLLM's regeneration replaced by
    canned answers: the head records the target's digest and goes under $CARTSPEC_HOME/heads/."""
    from cartspec.cli import app
    from cartspec.draft import features
    from cartspec.model.registry import head_target, target_digest

    seen = []

    def fake_generate(model_dir, prompts, sampling, out, **kw):
        seen.extend(prompts)
        return [{"prompt_ids": list(p), "output_ids": [300, 301, 302] * 5} for p in prompts]

    monkeypatch.setattr(features, "vllm_generate", fake_generate)
    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    f = _write(tmp_path / "p.jsonl", [{"query": "red shoes"}, {"messages": [{"role": "user", "content": "hi"}]}])
    res = CliRunner().invoke(app, ["draft", "train", "--target", str(tiny_llama_dir), "--prompts", str(f),
                                   "--sampled", "0", "--steps", "2", "--draft-vocab", "256", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    digest = target_digest(tiny_llama_dir)
    head = tmp_path / "home" / "heads" / f"custom-{digest[:8]}"
    assert head_target(head) == {"digest": digest, "name": str(tiny_llama_dir), "path": str(tiny_llama_dir)}
    provenance = (head / "PROVENANCE.md").read_text()
    assert "target digest " + digest in provenance
    from cartspec.serving.engine import compute_dtype

    # the dtype the features were captured in is recorded, where the training's compute dtype is too
    captured = str(compute_dtype("cpu")).removeprefix("torch.")
    assert f"features captured in\n  {captured}" in provenance
    assert f"compute dtype {captured}" in provenance
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    first, second = (tok.decode(p) for p in seen)
    assert SYSTEM["search"] in first and SYSTEM["search"] not in second and second.rstrip().endswith("assistant")
