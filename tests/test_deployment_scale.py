"""Typed scale settings in DeploymentSpec, and the example spec files."""

from __future__ import annotations

from pathlib import Path

import pytest

from cartspec.serving.spec import DeploymentSpec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_scale_fields_become_vllm_flags_and_stay_out_of_old_keys():
    s = DeploymentSpec(tensor_parallel_size=2, gpu_memory_utilization=0.9, enable_prefix_caching=False,
                       quantization="fp8")
    assert s.scale_args() == ["--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.9",
                              "--quantization", "fp8", "--no-enable-prefix-caching"]
    plain = DeploymentSpec().model_dump(mode="json")
    assert "tensor_parallel_size" not in plain  # unset: results recorded before keep their keys
    assert s.model_dump(mode="json")["tensor_parallel_size"] == 2
    assert DeploymentSpec.model_validate(s.model_dump(mode="json")) == s
    with pytest.raises(ValueError, match="engine_args passes --tensor-parallel-size too"):
        DeploymentSpec(tensor_parallel_size=2, engine_args=["--tensor-parallel-size", "4"])
    with pytest.raises(ValueError):
        DeploymentSpec(gpu_memory_utilization=1.5)


@pytest.mark.parametrize("name,tp,dp", [("cpu", None, None), ("gpu-8b", None, None), ("gpu-tp2", 2, None),
                                        ("gpu-dp2", None, 2)])
def test_example_specs_load(name, tp, dp):
    s = DeploymentSpec.load(EXAMPLES / f"{name}.yaml")
    assert (s.tensor_parallel_size, s.data_parallel_size) == (tp, dp)
    assert s.speculative.method == "eagle3" and s.speculative.num_speculative_tokens == 3
    if name != "cpu":
        assert s.gpu_memory_utilization == 0.9 and s.dtype == "bfloat16"


def test_server_command_carries_the_scale_flags(tiny_llama_dir):
    from cartspec.serving.server import VllmServer

    spec = DeploymentSpec(model=str(tiny_llama_dir), tensor_parallel_size=2, enable_prefix_caching=True,
                          engine_args=["--enable-per-request-metrics"])
    cmd = VllmServer(spec, port=8123, model_dir=tiny_llama_dir).command()
    assert cmd[-4:] == ["--tensor-parallel-size", "2", "--enable-prefix-caching", "--enable-per-request-metrics"]


def test_the_hybrid_anchor_example_reaches_the_servers_additional_config():
    from cartspec.drafting import KEY, HybridConfig

    s = DeploymentSpec.load(EXAMPLES / "cpu-hybrid-anchor.yaml")
    extra = s.speculative.additional_config()
    assert HybridConfig.from_dict(extra[KEY]) == HybridConfig(n_min=3, n_max=4, rule="anchor", scope="prompt")
    assert s.speculative.vllm_config("/heads/domain")["method"] == "eagle3"  # vLLM serves the head; cartspec combines


def test_the_hybrid_pointer_example_names_the_bundled_pointer_trained_for_its_model():
    from cartspec.model.registry import POINTERS_DIR, check_spec_head
    from cartspec.drafting import KEY, HybridConfig

    s = DeploymentSpec.load(EXAMPLES / "cpu-hybrid-pointer.yaml")
    cfg = HybridConfig.from_dict(s.speculative.additional_config()[KEY])
    assert cfg.rule == "pointer" and Path(cfg.pointer) == POINTERS_DIR / "commerce"
    assert check_spec_head(s) == "match"  # the head, and the pointer, were trained for the commerce model


def _config(path: Path, layers: int, kv_heads: int, head_dim: int) -> Path:
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "num_attention_heads": 9,
                                                  "num_key_value_heads": kv_heads, "head_dim": head_dim,
                                                  "hidden_size": 576}))
    return path


def test_a_kv_cache_that_fits_is_sized_from_the_model(tmp_path):
    from cartspec.serving.engine import kv_cache_gib

    smol = _config(tmp_path / "smol", 30, 3, 64)  # SmolLM2-135M: 46,080 bytes a token in float32
    assert kv_cache_gib(smol, "float32", 32, 1024) == 2  # 1.41 GiB, a quarter spare
    assert kv_cache_gib(smol, "bfloat16", 32, 1024) == 1
    assert kv_cache_gib(smol, "float32", 256, 4096) == 57  # it grows with what it must hold
    big = _config(tmp_path / "big", 32, 8, 128)  # an 8B Llama: 128 KiB a token in bf16
    assert kv_cache_gib(big, "bfloat16", 32, 1024) == 5


def test_a_server_told_to_fit_its_kv_cache_gets_that_size_and_a_users_setting_wins(tmp_path, monkeypatch):
    from cartspec.serving import server as server_mod
    from cartspec.serving.server import VllmServer

    monkeypatch.setattr(server_mod, "has_cuda", lambda: False)
    smol = _config(tmp_path / "smol", 30, 3, 64)
    spec = DeploymentSpec(model=str(smol), dtype="float32")
    assert VllmServer(spec, model_dir=smol).environment().get("VLLM_CPU_KVCACHE_SPACE") in (None, "4")
    fit = spec.model_copy(update={"kv_cache_fit": True})
    assert VllmServer(fit, model_dir=smol).environment()["VLLM_CPU_KVCACHE_SPACE"] == "2"
    own = fit.model_copy(update={"env": {"VLLM_CPU_KVCACHE_SPACE": "8"}})
    assert VllmServer(own, model_dir=smol).environment()["VLLM_CPU_KVCACHE_SPACE"] == "8"
    assert "kv_cache_fit" not in spec.model_dump(mode="json")  # unset: older results keep their keys
