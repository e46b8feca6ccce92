"""The serving dtype follows the machine: float32 where bf16 would be emulated, bf16 where it is native;
a user's explicit dtype always wins, and what ran is recorded."""

from __future__ import annotations

import pytest

from cartspec import machine
from cartspec.serving import engine
from cartspec.serving.spec import DeploymentSpec, Speculative


@pytest.fixture
def cpu(monkeypatch):
    def set_features(*feats):
        monkeypatch.setattr(machine, "has_cuda", lambda: False)
        monkeypatch.setattr(machine, "cpu_features", lambda: tuple(feats))
        engine.engine_versions.cache_clear()  # it records the features: never cache a faked machine
    yield set_features
    engine.engine_versions.cache_clear()


def test_an_avx2_only_cpu_serves_float32(cpu):
    cpu("avx2")
    assert engine.auto_dtype()[0] == "float32"
    assert "emulated" in engine.auto_dtype()[1]
    assert DeploymentSpec().resolved().dtype == "float32"


@pytest.mark.parametrize("feats", [("avx2", "avx512f", "avx512_bf16"), ("avx2", "avx512f", "amx_bf16", "amx_tile")])
def test_a_cpu_with_native_bf16_serves_bf16(cpu, feats):
    cpu(*feats)
    assert engine.auto_dtype()[0] == "bfloat16"
    assert DeploymentSpec().resolved().dtype == "bfloat16"


def test_avx512_without_bf16_is_still_float32(cpu):
    cpu("avx2", "avx512f")
    assert engine.auto_dtype()[0] == "float32"


def test_an_explicit_dtype_wins_over_the_machine(cpu):
    cpu("avx2")
    assert DeploymentSpec(dtype="bfloat16").resolved().dtype == "bfloat16"
    cpu("avx2", "avx512f", "avx512_bf16")
    assert DeploymentSpec(dtype="float32").resolved().dtype == "float32"


def test_the_vllm_command_carries_the_resolved_dtype(cpu, tmp_path):
    from cartspec.serving.server import VllmServer

    cpu("avx2")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    srv = VllmServer(DeploymentSpec(model=str(model)), log_dir=tmp_path, model_dir=model)
    cmd = srv.command()
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert srv.info().versions["dtype"] == "float32"


def test_the_hardware_line_names_the_cpu_features(cpu):
    cpu("avx2", "avx512f", "avx512_bf16")
    assert engine.hardware() == "CPU avx2+avx512f+avx512_bf16"


def test_a_study_plan_records_the_dtype_that_runs(cpu, tmp_path):
    """Resume keys and results say float32 or bfloat16, never "auto": two dtypes never share a point."""
    from cartspec.bench.plan import preset

    cpu("avx2")
    plan = preset("calibrate")
    f32 = [d.resolved() for d in plan.deployments]
    bf16 = [d.model_copy(update={"dtype": "bfloat16"}).resolved() for d in plan.deployments]
    assert {p.spec["dtype"] for d in f32 for p in plan.points(d)} == {"float32"}
    keys32 = {p.key for d in f32 for p in plan.points(d)}
    keys16 = {p.key for d in bf16 for p in plan.points(d)}
    assert not keys32 & keys16


def test_cpu_features_are_read_from_this_machine():
    machine.cpu_features.cache_clear()
    feats = engine.cpu_features()
    assert set(feats) <= set(machine._CPU_FEATURES)
    with open("/proc/cpuinfo") as fh:
        flags = next((ln.split(":", 1)[1].split() for ln in fh if ln.startswith("flags")), [])
    assert ("avx2" in feats) == ("avx2" in flags)


def test_results_name_the_gpu_model_and_count_on_cuda(monkeypatch):
    import torch

    names = ["NVIDIA H200", "NVIDIA H200"]
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: names[i])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    engine.engine_versions.cache_clear()
    try:
        v = engine.engine_versions()
        assert (v["gpu"], v["gpu_count"], v["device"]) == ("NVIDIA H200", "2", "cuda")
        assert v["hardware"] == "2x NVIDIA H200" and v["auto_dtype"] == "bfloat16"
        names[1] = "NVIDIA A100-SXM4-80GB"  # a mixed machine names every model
        engine.engine_versions.cache_clear()
        assert engine.engine_versions()["gpu"] == "NVIDIA H200, NVIDIA A100-SXM4-80GB"
    finally:
        engine.engine_versions.cache_clear()


def test_results_on_a_cpu_carry_no_gpu_keys(cpu):
    cpu("avx2")
    v = engine.engine_versions()
    assert "gpu" not in v and "gpu_count" not in v and v["cpu_features"] == "avx2"


def test_a_result_names_the_commit_that_measured_it(tmp_path):
    import shutil
    import subprocess

    if not shutil.which("git"):
        pytest.skip("git is not installed")
    assert engine.source_commit(tmp_path) == "-"  # not a checkout (an installed wheel)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert engine.source_commit(tmp_path) == head
    (tmp_path / "new.py").write_text("")  # untracked files do not make it dirty
    assert engine.source_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert engine.source_commit(tmp_path) == head + "+dirty"
    assert "cartspec_commit" in engine.engine_versions()


def test_a_schedule_is_checked_and_looked_up_like_vllm():
    sp = Speculative(method="eagle3", model="domain", num_speculative_tokens=3, schedule=[(1, 1, 3), (2, 8, 2),
                                                                                           (9, 64, 0)])
    assert [sp.gamma_at(b) for b in (1, 2, 8, 9, 64, 100)] == [3, 2, 2, 0, 0, 0]
    assert sp.vllm_config("/h")["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 8, 2], [9, 64, 0]]
    with pytest.raises(ValueError, match="above num_speculative_tokens"):
        Speculative(method="eagle3", model="domain", num_speculative_tokens=2, schedule=[(1, 64, 3)])
    with pytest.raises(ValueError, match="start at 1"):
        Speculative(method="eagle3", model="domain", num_speculative_tokens=3, schedule=[(2, 64, 3)])


def test_an_adaptive_spec_cannot_start_untuned():
    sp = Speculative(method="eagle3", model="domain", adaptive=True)
    assert sp.label == "eagle3-domain-auto"
    with pytest.raises(ValueError, match="tuned first"):
        sp.vllm_config("/h")


def test_training_and_feature_capture_compute_in_the_dtype_the_cpu_runs_natively(cpu, monkeypatch):
    import torch

    monkeypatch.delenv("CARTSPEC_COMPUTE_DTYPE", raising=False)
    cpu("avx2")
    assert engine.compute_dtype("cpu") == torch.float32  # bf16 autocast would be emulated
    cpu("avx2", "avx512f", "avx512_bf16")
    assert engine.compute_dtype("cpu") == torch.bfloat16
    monkeypatch.setenv("CARTSPEC_COMPUTE_DTYPE", "float32")
    assert engine.compute_dtype("cpu") == torch.float32  # the user's choice wins
    monkeypatch.setenv("CARTSPEC_COMPUTE_DTYPE", "fp8")
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        engine.compute_dtype("cpu")

