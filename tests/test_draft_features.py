"""Feature capture: the aux states we train on are the ones vLLM hands the head
(layer-id convention, checked with vLLM's own capture code on the tiny model),
and extraction writes resumable shards."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    m.eval()
    return m


def vllm_style_aux(model, input_ids, layer_ids):
    """Run the HF model and hand vLLM's ``EagleModelMixin._maybe_add_hidden_state``
    exactly what vLLM's fused Llama loop has after each layer: (mlp output,
    residual after the attention add), with ``idx + 1`` as the layer id, and
    the embeddings (residual None) for id 0."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    holder = SimpleNamespace(aux_hidden_state_layers=tuple(sorted(set(layer_ids))))
    per_layer = {}
    hooks = []
    for idx, layer in enumerate(model.model.layers):
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda mod, args, idx=idx: per_layer.setdefault(idx, {}).__setitem__("residual", args[0].clone())))
        hooks.append(layer.mlp.register_forward_hook(
            lambda mod, args, out, idx=idx: per_layer.setdefault(idx, {}).__setitem__("hidden", out.clone())))
    with torch.no_grad():
        model(input_ids=input_ids)
        emb = model.model.embed_tokens(input_ids)
    for h in hooks:
        h.remove()
    aux: list[torch.Tensor] = []
    EagleModelMixin._maybe_add_hidden_state(holder, aux, 0, emb, None)
    for idx in range(len(model.model.layers)):
        EagleModelMixin._maybe_add_hidden_state(holder, aux, idx + 1, per_layer[idx]["hidden"],
                                                per_layer[idx]["residual"])
    return torch.cat(aux, dim=-1)


@pytest.mark.parametrize("layer_ids", [[1, 2], [0, 2, 3], [1, 2, 3]])
def test_captured_aux_equals_what_vllm_captures(tiny_model, layer_ids):
    from cartspec.draft.features import capture

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 9))
    aux, final, argmax = capture(tiny_model, ids, torch.ones_like(ids), layer_ids)
    want = vllm_style_aux(tiny_model, ids, layer_ids)
    torch.testing.assert_close(aux, want, rtol=1e-5, atol=1e-5)
    # final = the normed last state: the target's logits come from it
    logits = tiny_model(input_ids=ids).logits
    torch.testing.assert_close(final @ tiny_model.lm_head.weight.T, logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(argmax, logits.argmax(-1))


def test_off_by_one_layer_would_be_caught(tiny_model):
    """The check above is sharp: HF entry j+1 (the output of layer j) is not vLLM's id j."""
    from cartspec.draft.features import capture

    ids = torch.randint(0, 1000, (1, 7))
    aux, _, _ = capture(tiny_model, ids, torch.ones_like(ids), [2])
    with torch.no_grad():
        hs = tiny_model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(aux, vllm_style_aux(tiny_model, ids, [2]))
    assert not torch.allclose(hs[3], vllm_style_aux(tiny_model, ids, [2]))


def test_default_layer_ids_for_model(tiny_llama_dir, tmp_path):
    import json
    import shutil

    from cartspec.draft.features import aux_layer_ids_for

    assert aux_layer_ids_for(tiny_llama_dir) == [1, 2]  # vLLM: (2, 4//2, 4-3) -> sorted set
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 30
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert aux_layer_ids_for(tmp_path) == [2, 15, 27]


def test_extract_shards_resume(tiny_llama_dir, tiny_model, tmp_path):
    from safetensors.torch import load_file

    from cartspec.draft.features import FeatureSet, capture, extract

    torch.manual_seed(1)
    records = [{"prompt_ids": torch.randint(0, 1000, (int(torch.randint(4, 9, ())),)).tolist(),
                "output_ids": torch.randint(0, 1000, (int(torch.randint(2, 7, ())),)).tolist()} for _ in range(5)]
    paths = extract(tiny_llama_dir, records, tmp_path, [1, 2], shard_size=2)
    assert [p.name for p in paths] == ["shard-00000.safetensors", "shard-00001.safetensors",
                                       "shard-00002.safetensors"]
    before = {p: (p.stat().st_mtime_ns, load_file(str(p))) for p in paths}
    paths[1].unlink()
    extract(tiny_llama_dir, records, tmp_path, [1, 2], shard_size=2)
    assert paths[0].stat().st_mtime_ns == before[paths[0]][0]  # untouched
    assert paths[2].stat().st_mtime_ns == before[paths[2]][0]
    again = load_file(str(paths[1]))
    for k, v in before[paths[1]][1].items():
        assert torch.equal(again[k], v), k

    fs = FeatureSet.load(paths)
    assert fs.n_seqs == 5 and fs.layer_ids == [1, 2]
    r = records[3]
    seq = torch.tensor([r["prompt_ids"] + r["output_ids"]])
    aux, final, _ = capture(AutoModel(tiny_llama_dir), seq, torch.ones_like(seq), [1, 2])
    sl = fs.seq(3)
    assert fs.input_ids[sl].tolist() == seq[0].tolist()
    assert int(fs.prompt_lens[3]) == len(r["prompt_ids"])
    # stored bf16 from a bf16 forward: close to the fp32 states
    torch.testing.assert_close(fs.aux[sl].float(), aux[0], rtol=0.05, atol=0.05)
    assert list(fs.response_tokens())[:len(records[0]["output_ids"])] == records[0]["output_ids"]


def AutoModel(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_the_generators_progress_is_a_json_line_at_most_every_interval_and_at_the_end(monkeypatch, capsys):
    """vLLM's offline progress bar becomes lines the caller relays: none before the interval, one at the end."""
    from cartspec.draft import vllm_generate as gen

    monkeypatch.setattr(gen, "PROGRESS_EVERY_S", 3600.0)
    bar = gen.LineProgress(total=3)
    bar.update(1)
    bar.update(1)
    assert capsys.readouterr().out == ""  # nothing drawn, nothing said before the interval
    bar.update(1)
    bar.close()
    said = json.loads(capsys.readouterr().out)
    assert (said["progress"], said["total"]) == (3, 3) and said["elapsed_s"] >= 0


def test_a_generator_that_dies_raises_with_vllms_log_kept_and_caches_nothing(monkeypatch, tmp_path):
    """vLLM failing mid-generation: the error carries its log's tail, the log stays beside the output for
    the user, the progress said before it was relayed, and no partial records are cached as done."""
    import sys

    from cartspec.draft import features

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '{not json' && echo 7\necho '{\"progress\": 1, \"total\": 2, \"elapsed_s\": 0.5}'\n"
                    "echo 'RuntimeError: engine core died' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    said, out = [], tmp_path / "gen.jsonl"
    with pytest.raises(RuntimeError, match=r"exit 3\)[\s\S]*engine core died"):
        features.vllm_generate(tmp_path, [[1, 2]], [features.Sampling(max_tokens=2)], out, log=said.append)
    assert "engine core died" in out.with_suffix(".log").read_text()
    assert "vLLM generation: 1/2 answers, 0s" in said and not out.exists()
