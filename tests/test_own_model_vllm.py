"""The "your own model" path end to end in real vLLM on CPU, on a tiny random Llama 3.1-style target
(``rope_scaling`` llama3): ``cartspec draft train --target DIR --prompts FILE.jsonl`` (chat lines and
request lines mixed), then acceptance in vLLM and in the simulator."""

from __future__ import annotations

import json
import random

import pytest
from conftest import make_tiny_target
from typer.testing import CliRunner

import os

# Trains a head (minutes on 2 cores) before starting vLLM: a must-show run, not part of the CI suite.
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    os.environ.get("CARTSPEC_HEAVY_TESTS") != "1",
    reason="trains a head for minutes before vLLM starts; run with CARTSPEC_HEAVY_TESTS=1")]


@pytest.mark.timeout(1500)
def test_train_a_head_for_a_users_llama3_target_and_measure_it(tokenizer_dir, tmp_path):
    from cartspec.cli import app
    from cartspec.draft.acceptance import load_data, measure_simulated, measure_vllm

    target = make_tiny_target("llama3", tmp_path / "target", tokenizer_dir)
    rng = random.Random(0)
    words = "red blue shoes jacket size price under cheap leather running wool hat return order refund".split()
    with (tmp_path / "prompts.jsonl").open("w") as fh:
        for i in range(96):
            q = " ".join(rng.choice(words) for _ in range(rng.randrange(4, 10)))
            fh.write(json.dumps({"messages": [{"role": "user", "content": q}]} if i % 2 else {"query": q}) + "\n")
    head = tmp_path / "head"
    res = CliRunner().invoke(app, [
        "draft", "train", "--target", str(target), "--prompts", str(tmp_path / "prompts.jsonl"), "--out", str(head),
        "--max-tokens", "40", "--sampled", "0", "--steps", "200", "--draft-vocab", "2048", "--ttt-steps", "3",
        "--lr", "2e-3", "--enforce-eager", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    conf = json.loads((head / "config.json").read_text())
    assert conf["rope_parameters"]["rope_type"] == "llama3"  # vLLM's drafter rotates as the target does
    reqs = load_data(str(tmp_path / "prompts.jsonl"), limit=32)
    real = measure_vllm(str(target), "eagle3", 3, reqs, head=str(head), max_tokens=40, enforce_eager=True,
                        log_dir=tmp_path / "logs", concurrency=8)
    sim = measure_simulated(str(target), "eagle3", 3, reqs, head=str(head), max_tokens=40, enforce_eager=True)
    assert real["tau"] > 1.3, real
    assert abs(sim["tau"] - real["tau"]) <= 0.10 * real["tau"], (sim["tau"], real["tau"])
