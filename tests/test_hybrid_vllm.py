"""Real vLLM on CPU runs the hybrid drafter, and the simulator replays it step for step.

A tiny random Llama and an untrained (random) EAGLE-3 head: the head's drafts are almost never
right, so what is accepted comes from the prompt lookup the hybrid adds in the runner
(``vllm_plugin/hybrid.py``, loaded by cartspec's vLLM plugin). The simulator
(``draft.simulate.simulate_hybrid``), given the same greedy outputs and the same head, must place the
same accepted counts on the same verify steps; the head alone must not (else the test could not tell
whether the hybrid ran).
"""

from __future__ import annotations

import json

import pytest
from conftest import make_random_head

pytestmark = pytest.mark.vllm


@pytest.mark.timeout(900)
def test_hybrid_in_vllm_matches_the_simulator(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    from cartspec.draft.acceptance import measure_simulated, measure_vllm
    from cartspec.drafting import HybridConfig
    from cartspec.task.generator import generate

    head_dir = make_random_head(tiny_llama_dir, tmp_path / "head")
    reqs = generate("test", 10, 0)
    cfg = HybridConfig(n_min=2, n_max=4, rule="lookup", scope="context")
    real = measure_vllm(str(tiny_llama_dir), "hybrid", 3, reqs, head=str(head_dir), concurrency=4, max_tokens=32,
                        log_dir=tmp_path / "logs", enforce_eager=True, hybrid=cfg)
    (tmp_path / "real.json").write_text(json.dumps(real, indent=1))
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert "cartspec: hybrid drafts in this runner" in logs and "cartspec patch: hybrid applied" in logs
    assert real["requests_without_step_metrics"] == 0
    assert real["accepted_tokens"] > 0, real  # a random head alone accepts ~nothing

    sim = measure_simulated(str(tiny_llama_dir), "hybrid", 3, reqs, head=str(head_dir), max_tokens=32,
                            enforce_eager=True, hybrid=cfg)
    head_only = measure_simulated(str(tiny_llama_dir), "hybrid", 3, reqs, head=str(head_dir), max_tokens=32,
                                  enforce_eager=True, hybrid=HybridConfig(rule="head"))
    assert head_only["accepted_tokens"] < real["accepted_tokens"] / 2
    # the same greedy replies, so the same verify steps with the same accepted counts. The replies run
    # to max_tokens here: vLLM's last step drafts past the cap and counts drafts whose tokens are then
    # cut off, the simulator only what fits, so each reply's last step is left out of the comparison.
    pairs = [(a["per_step_accepted"], b) for a, b in zip(real["replies"], sim["per_step_accepted"])]
    same = sum(len(a) == len(b) and a[:-1] == b[:-1] for a, b in pairs)
    assert same >= len(reqs) - 1, pairs
    acc_real = sum(sum(a[:-1]) for a, _ in pairs)
    acc_sim = sum(sum(b[:-1]) for _, b in pairs)
    assert acc_real > 0 and abs(acc_sim - acc_real) <= 0.05 * acc_real, (acc_sim, acc_real)


@pytest.mark.timeout(900)
def test_the_pointer_rule_loads_in_vllm_and_matches_the_simulator(tiny_llama_dir, tmp_path, monkeypatch):
    """Rule ``pointer`` with a pointer trained for the tiny model: vLLM loads it in the runner and places
    the same accepted counts on the same steps as the simulator (the lookup's copies are what a random
    model accepts; the pointer, asked at every value start, must not change what the two agree on)."""
    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    from transformers import AutoTokenizer

    from cartspec.draft.acceptance import measure_simulated, measure_vllm
    from cartspec.draft.pointer import sequences_from_gold, train_pointer
    from cartspec.model.registry import target_digest
    from cartspec.drafting import HybridConfig, TokenInfo
    from cartspec.task.generator import generate

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ptr = tmp_path / "pointer"
    train_pointer(tiny_llama_dir, sequences_from_gold(tok, generate("train", 40, 0)), TokenInfo.from_tokenizer(tok),
                  ptr, epochs=1, log=lambda m: None, target={"name": "tiny", "digest": target_digest(tiny_llama_dir)})
    head_dir = make_random_head(tiny_llama_dir, tmp_path / "head")
    reqs = generate("test", 10, 0)
    cfg = HybridConfig(n_min=2, n_max=4, rule="pointer", scope="context", pointer=str(ptr))
    real = measure_vllm(str(tiny_llama_dir), "hybrid", 3, reqs, head=str(head_dir), concurrency=4, max_tokens=32,
                        log_dir=tmp_path / "logs", enforce_eager=True, hybrid=cfg)
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert f"cartspec: hybrid pointer {ptr}" in logs
    assert real["hybrid"]["rule"] == "pointer" and real["accepted_tokens"] > 0, real
    sim = measure_simulated(str(tiny_llama_dir), "hybrid", 3, reqs, head=str(head_dir), max_tokens=32,
                            enforce_eager=True, hybrid=cfg)
    pairs = [(a["per_step_accepted"], b) for a, b in zip(real["replies"], sim["per_step_accepted"])]
    assert sum(len(a) == len(b) and a[:-1] == b[:-1] for a, b in pairs) >= len(reqs) - 1, pairs


@pytest.mark.timeout(900)
def test_the_gate_reads_the_heads_probabilities_inside_vllm(tiny_llama_dir, tmp_path, monkeypatch):
    """The gate (``head_p``) needs the head's probability of each token it drafts, which cartspec records in
    vLLM's drafter. With ``head_p`` tiny every copy that differs from the head gives way to the head (a random
    head's top probability is far above 1e-6), so the hybrid drafts as the head alone and accepts about
    nothing, in vLLM as in the simulator; without the probabilities vLLM would keep the lookup's copies,
    which the same replies accept."""
    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    from cartspec.draft.acceptance import measure_simulated, measure_vllm
    from cartspec.drafting import HybridConfig
    from cartspec.task.generator import generate

    head_dir = make_random_head(tiny_llama_dir, tmp_path / "head")
    reqs = generate("test", 10, 0)
    gated = HybridConfig(n_min=2, n_max=4, rule="lookup", scope="context", head_p=1e-6)
    real = measure_vllm(str(tiny_llama_dir), "hybrid", 3, reqs, head=str(head_dir), concurrency=4, max_tokens=32,
                        log_dir=tmp_path / "logs", enforce_eager=True, hybrid=gated)
    assert real["hybrid"]["head_p"] == 1e-6 and real["requests_without_step_metrics"] == 0
    kw = dict(head=str(head_dir), max_tokens=32, enforce_eager=True)
    copies = measure_simulated(str(tiny_llama_dir), "hybrid", 3, reqs, **kw,
                               hybrid=HybridConfig(n_min=2, n_max=4, rule="lookup", scope="context"))
    sim = measure_simulated(str(tiny_llama_dir), "hybrid", 3, reqs, **kw, hybrid=gated)
    assert copies["accepted_tokens"] > 2 * max(real["accepted_tokens"], 1), (copies["accepted_tokens"], real)
    pairs = [(a["per_step_accepted"], b) for a, b in zip(real["replies"], sim["per_step_accepted"])]
    assert sum(len(a) == len(b) and a[:-1] == b[:-1] for a, b in pairs) >= len(reqs) - 1, pairs
