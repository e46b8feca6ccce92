"""Owned vLLM server processes.

``VllmServer`` starts ``python -m vllm.entrypoints.openai.api_server`` in its own
process group on a free loopback port, logs to a file, waits for ``/health``,
and always stops the whole group: on ``__exit__``, on interpreter exit, and on
SIGTERM/SIGHUP of a caller that called ``install_signal_handlers()`` (the CLI
does; Ctrl-C raises ``KeyboardInterrupt``, which unwinds through ``__exit__``
or ``atexit``). A start that fails raises
``DeploymentError`` carrying the reason and the log tail.

A caller can also die without running any Python (SIGKILL, OOM killer, a
segfault). For that each server gets a watchdog (``serving.process``, which
the agent's own process owner shares) that kills the whole vLLM group.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from ..private_files import open_private, private_dir
from . import process
from .engine import engine_env, engine_versions, has_cuda, kv_cache_gib, resolve_dtype
from .spec import DeploymentSpec
from ..vllm_plugin.support import BY_NAME, drafters_of

class DeploymentError(RuntimeError):
    """A deployment that could not start or died; ``log_tail`` says why."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message + (f"\n--- vLLM log (last lines) ---\n{log_tail}" if log_tail else ""))
        self.reason = message
        self.log_tail = log_tail


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_EXCEPTION_LINE = re.compile(r"\b((?:[a-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)): (.+)$")
# What every request in flight reports after the engine core died: never the cause.
_CONSEQUENCES = ("EngineDeadError", "EngineCore encountered an issue", "EngineGenerateError")


def root_cause(log: str) -> str | None:
    """The first exception a server logged that is not a consequence of an earlier one.

    When vLLM's engine core dies, the worker's ``RuntimeError: ...`` comes first and is then
    buried under one ``EngineDeadError`` per request in flight (thousands of lines at c=32)."""
    for line in log.splitlines():
        if any(f" {level} " in line for level in ("WARNING", "INFO", "DEBUG")):
            continue
        m = _EXCEPTION_LINE.search(line)
        if m and not any(c in line for c in _CONSEQUENCES):
            return f"{m.group(1)}: {m.group(2).strip()}"[:400]
    return None


def read_log(path: Path, max_bytes: int = 8 << 20) -> str:
    """The last ``max_bytes`` of a log, or "" if there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(read_log(path).splitlines()[-n:])


def _reason(log: str) -> str:
    """The most telling line of a failed start."""
    for line in reversed(log.splitlines()):
        low = line.lower()
        if any(k in low for k in ("error", "exception", "valueerror", "unsupported", "not found")):
            return line.strip()[-400:]
    return "the server exited before it became healthy"


@dataclass
class ServerInfo:
    url: str
    model_name: str
    spec: dict[str, Any]
    versions: dict[str, str]
    log_path: str


VLLM_MODULE = "vllm.entrypoints.openai.api_server"
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's api_server requires this key on /v1/* (``--api-key`` wins over it)
# the plugin's patches a method cannot draft without: its start is refused where one did not apply
def needs_patches(spec: DeploymentSpec) -> tuple[str, ...]:
    """The plugin's patches this deployment cannot draft as asked without: those of each drafter it asks for
    (``vllm_plugin.support.DRAFTERS``, the one list of what each drafter needs)."""
    return tuple(dict.fromkeys(p for d in drafters_of(spec) if d in BY_NAME for p in BY_NAME[d].patches))


class VllmServer:
    """Context manager owning one vLLM OpenAI-compatible server.

    ``api_key``: what vLLM requires on ``/v1/*`` (``Authorization: Bearer KEY``); by default a random key made
    here, so that no other local user can reach the engine past whoever started it. It reaches vLLM through the
    environment (``VLLM_API_KEY``), never the command line, which ``ps`` shows and the log records; a restart
    keeps it, so clients keep their key with their URL. ``patches`` (after ``start``): what cartspec's vLLM
    plugin reported doing in it (``vllm_plugin``)."""

    patches: dict[str, Any] = {}

    def __init__(self, spec: DeploymentSpec, log_dir: str | Path = "runs/logs", port: int | None = None,
                 model_dir: str | Path | None = None, head_dir: str | Path | None = None,
                 api_key: str | None = None):
        self.spec = spec
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.port = port or free_port()
        self.log_dir = Path(log_dir)
        self.model_dir = Path(model_dir) if model_dir else None
        self.head_dir = Path(head_dir) if head_dir else None
        self.proc: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None
        self._watch_fd: int | None = None
        self._log = None
        self.log_path = self.log_dir / f"vllm-{spec.name}-{spec.label}-{self.port}.log"
        # where cartspec's vLLM plugin writes the engine's step times (``vllm_plugin.steps``)
        self.step_stats_path = self.log_path.with_suffix(".steps.json")

    # --- command line -----------------------------------------------------
    def _resolve(self) -> tuple[Path, str | None]:
        from ..model.registry import resolve_head, resolve_model

        model = self.model_dir or resolve_model(self.spec.model)
        head = None
        sp = self.spec.speculative
        if sp.method in ("eagle3", "hybrid"):
            head = str(self.head_dir or resolve_head(sp.model))
        elif sp.method == "draft_model":
            head = str(self.head_dir or resolve_model(sp.model))
        return Path(model), head

    def command(self) -> list[str]:
        model, head = self._resolve()
        s = self.spec
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model), "--served-model-name", s.name,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", resolve_dtype(s.dtype), "--max-model-len", str(s.max_model_len),
               "--max-num-seqs", str(s.max_num_seqs), "--seed", str(s.seed),
               "--uvicorn-log-level", "warning"]
        if s.enforce_eager:
            cmd.append("--enforce-eager")
        extra = s.speculative.additional_config(str(model))
        if extra:  # the hybrid's or the schema drafter's settings, for cartspec's vLLM plugin
            # keys in their own order: a JSON schema's property order is the order its keys are written in
            cmd += ["--additional-config", json.dumps(extra)]
        spec_cfg = s.speculative.vllm_config(head)
        if spec_cfg:
            cmd += ["--speculative-config", json.dumps(spec_cfg),
                    "--per-request-spec-decode-metrics", "detailed"]
        return cmd + s.scale_args() + list(s.engine_args)

    def environment(self) -> dict[str, str]:
        """The vLLM process's environment: ours, the engine's defaults, the speculation's and the spec's, and the
        server's key (``VLLM_API_KEY``, which vLLM requires on ``/v1/*``)."""
        model, head = self._resolve()
        env = {**os.environ, **engine_env(), **self.spec.env}
        if self.spec.kv_cache_fit and not has_cuda() and "VLLM_CPU_KVCACHE_SPACE" not in self.spec.env:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib(model, resolve_dtype(self.spec.dtype),
                                                             self.spec.max_num_seqs, self.spec.max_model_len, head))
        # cartspec's vLLM plugin (vllm_plugin) loads in every vLLM process through vLLM's entry point; a user's
        # VLLM_PLUGINS list would leave it out
        plugins = env.get("VLLM_PLUGINS")
        if plugins is not None and "cartspec" not in [p.strip() for p in plugins.split(",")]:
            env["VLLM_PLUGINS"] = ",".join(p for p in (plugins.strip(), "cartspec") if p)
        from ..vllm_plugin.steps import ENV as STEP_STATS

        env.setdefault(STEP_STATS, str(self.step_stats_path.resolve()))
        env[API_KEY_ENV] = self.api_key  # last: ours, whatever the caller's environment held
        return env

    # --- lifecycle --------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "VllmServer":
        if process.shutting_down():
            raise DeploymentError("not starting vLLM: this program is stopping")
        cmd = self.command()
        if VLLM_MODULE in cmd:  # a drafter this vLLM cannot run is refused before it starts (vllm_plugin.support)
            from ..vllm_plugin.support import UnsupportedDrafter, check_drafter_supported

            try:
                check_drafter_supported(self.spec)
            except UnsupportedDrafter as exc:
                raise DeploymentError(str(exc)) from None
        env = self.environment()
        self._log = self._open_log()
        self._log.write("$ " + " ".join(cmd) + "\n")
        self._log.flush()
        # Own process group: stop() can kill the engine's worker children too.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        process.register(self)
        try:
            self._start_watchdog(self.proc.pid)
            self._wait_healthy(self.spec.start_timeout_s)
            self.patches = self._patch_report(VLLM_MODULE in cmd,
                                              needs=needs_patches(self.spec))
        except BaseException:
            self.stop()
            raise
        return self

    def _open_log(self) -> IO[str]:
        """The log, truncated, for this start: 0600 in a 0700 ``log_dir``, never opened through a symlink (vLLM
        logs requests' errors, which can quote them). A directory another user owns or others may write, or a
        link in the log's place, fails the start with what to do."""
        try:
            private_dir(self.log_dir)
            return open_private(self.log_path, "w")
        except OSError as e:  # UnsafePathError included
            raise DeploymentError(f"cannot write the vLLM log {self.log_path}: {e}") from None

    def _patch_report(self, real_vllm: bool, needs: tuple[str, ...] = ()) -> dict[str, Any]:
        """What cartspec's vLLM plugin reported in the log (``vllm_plugin.read_report``): patch name -> its
        status. A real vLLM that reported nothing ran without the plugin, and a deployment whose ``needs`` (the
        hybrid's patch) did not apply cannot draft as asked: both refused, with what to do."""
        from ..vllm_plugin import not_loaded, read_report

        try:
            report = read_report(self.log_path.read_text(errors="replace"))
        except OSError:
            report = {}
        if real_vllm and not report:
            raise DeploymentError(not_loaded(sys.executable), tail(self.log_path))
        for name in needs:
            status = report.get(name)
            if real_vllm and (status is None or status.status != "applied"):
                raise DeploymentError(f"this deployment needs cartspec's vLLM patch {name!r}, which did not apply "
                                      f"in this vLLM: {status.reason if status else 'not reported'} "
                                      "(`cartspec doctor` checks every patch against the installed vLLM)",
                                      tail(self.log_path))
        return report

    def _start_watchdog(self, pgid: int) -> None:
        self._watchdog, self._watch_fd = process.start_watchdog(pgid)

    def restart(self) -> "VllmServer":
        """Stop (if running) and start again on the same port, so clients keep their URL."""
        self.stop()
        return self.start()

    def pids(self) -> list[int]:
        """Every live process of this deployment (the server and the engine workers it spawned)."""
        return process.group_pids(self.proc)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # with the key: vLLM leaves /health open, but a stand-in or a later vLLM may guard every path
        with httpx.Client(timeout=2.0, headers={"Authorization": f"Bearer {self.api_key}"}) as client:
            while time.monotonic() < deadline:
                proc = self.proc
                if proc is None:  # stop() from another thread while we waited
                    raise DeploymentError("vLLM was stopped while it was starting")
                if proc.poll() is not None:
                    log = tail(self.log_path)
                    raise DeploymentError(f"vLLM exited with code {proc.returncode}: {_reason(log)}", log)
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        raise DeploymentError(f"vLLM did not become healthy within {timeout:.0f}s", tail(self.log_path))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            self._stop_group(proc, grace)
        finally:
            self._stop_watchdog()
            if self._log is not None:
                self._log.close()
                self._log = None
            process.unregister(self)

    def _stop_group(self, proc: subprocess.Popen, grace: float) -> None:
        process.stop_group(proc, grace)

    def _stop_watchdog(self) -> None:
        fd, self._watch_fd = self._watch_fd, None
        wd, self._watchdog = self._watchdog, None
        process.stop_watchdog(wd, fd)

    def info(self) -> ServerInfo:
        model, head = self._resolve()
        return ServerInfo(url=self.url, model_name=self.spec.name, spec=self.spec.model_dump(mode="json"),
                          versions={**engine_versions(), "model_dir": str(model), "head_dir": head or "",
                                    "dtype": resolve_dtype(self.spec.dtype), **self._preload(),
                                    **self._drafting(str(model))},
                          log_path=str(self.log_path))

    def _preload(self) -> dict[str, str]:
        """On a CPU, what vLLM ran with in ``LD_PRELOAD`` (``ld_preload``: the libraries' names; "" where vLLM
        chose, which is torch's libgomp): Intel OpenMP and tcmalloc change its speed (``engine.cpu_preload``)."""
        if has_cuda():
            return {}
        value = self.environment().get("LD_PRELOAD", "")
        return {"ld_preload": ":".join(Path(x).name for x in value.replace(" ", ":").split(":") if x)}

    def _drafting(self, model: str) -> dict[str, str]:
        """The patches the plugin reported (``vllm_patches``) and the hybrid's resolved settings (``hybrid``)."""
        from ..vllm_plugin import summary

        out = {"vllm_patches": summary(self.patches)} if self.patches else {}
        cfg = self.spec.speculative.hybrid_config(model)
        if cfg is not None:
            out["hybrid"] = cfg.to_json()
        return out

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_all(*_: Any) -> None:
    process.stop_all(grace=5.0)  # every owned process: vLLM servers, and agents a drill started


def _on_signal(signum, frame):  # noqa: ARG001
    process.begin_shutdown()  # first: a supervisor must not restart what is stopped next
    _stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install_signal_handlers() -> None:
    """Stop every live server on SIGTERM/SIGHUP, then die of the signal as before. Idempotent.

    Called by the programs that own servers (the ``cartspec`` CLI, the benchmark drills), not at
    import: a library import must not take over its host's signal handling. A handler someone else
    installed is left alone, and so is everything off the main thread (Python allows no handler there).
    """
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # not in the main thread
            pass
