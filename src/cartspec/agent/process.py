"""The agent as a process this one owns: ``cartspec serve`` started as in production, for the drills and tests.

``AgentProcess(config, serve_args, out_dir)`` writes the config (on loopback, on a free port unless
given one) to ``OUT/NAME.yaml``,
starts ``cartspec serve --config OUT/NAME.yaml SERVE_ARGS`` in its own process group with its output
in ``OUT/NAME.log`` (OUT 0700, the log 0600), and waits for ``/ready``. It stops the whole group (the agent, and the vLLMs it
started) on ``__exit__``, at interpreter exit, on SIGTERM/SIGHUP of a caller that installed
``serving.server.install_signal_handlers``, and through the watchdog of ``serving.process`` however
the caller dies. A start that fails raises ``AgentError`` with the first exception the agent logged.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import httpx

from ..private_files import open_private, private_dir
from ..serving import process
from ..serving.server import free_port, read_log, root_cause, tail
from .config import AgentConfig


class AgentError(RuntimeError):
    """An agent that could not start; ``log_tail`` says why."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message + (f"\n--- agent log (last lines) ---\n{log_tail}" if log_tail else ""))
        self.reason = message
        self.log_tail = log_tail


class AgentProcess:
    """Context manager owning one ``cartspec serve`` process."""

    def __init__(self, config: AgentConfig, serve_args: Sequence[str] = (), out_dir: str | Path = "runs/agent",
                 name: str = "agent", port: int | None = None, start_timeout_s: float = 60.0):
        # A free port unless told: the config's default one may be taken (another drill, a user's serve).
        self.config = config.model_copy(update={"port": port or free_port(), "host": "127.0.0.1"})
        self.serve_args = list(serve_args)
        self.out_dir = Path(out_dir)
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.config_path = self.out_dir / f"{name}.yaml"
        self.log_path = self.out_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None
        self._watch_fd: int | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "cartspec.cli", "serve", "--config", str(self.config_path), *self.serve_args]

    def start(self) -> "AgentProcess":
        # 0700: the config can hold the API key, the log the agent's errors; the log itself 0600, never a link's
        private_dir(self.out_dir)
        self.config.save(self.config_path)
        cmd = self.command()
        self._log = open_private(self.log_path, "w")
        self._log.write("$ " + " ".join(cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        process.register(self)
        try:
            self._watchdog, self._watch_fd = process.start_watchdog(self.proc.pid)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            proc = self.proc
            if proc is None:
                raise AgentError("the agent was stopped while it was starting")
            if proc.poll() is not None:
                raise AgentError(f"the agent exited with code {proc.returncode}: {self._cause()}", tail(self.log_path))
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AgentError(f"the agent was not ready within {self.start_timeout_s:.0f}s", tail(self.log_path))

    def _cause(self) -> str:
        """The first exception the agent logged, else its last line (``cartspec serve`` prints ``error: ...``)."""
        log = read_log(self.log_path)
        lines = [ln.strip() for ln in log.splitlines() if ln.strip() and not ln.startswith("$ ")]
        return root_cause(log) or (lines[-1][-400:] if lines else "it exited before it became ready")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> list[int]:
        """Every live process of the agent's group (the agent, and the vLLMs it started)."""
        return process.group_pids(self.proc)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM (the agent stops the vLLMs it started), then SIGKILL to what is left after ``grace``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            process.stop_group(proc, grace)
        finally:
            wd, fd = self._watchdog, self._watch_fd
            self._watchdog = self._watch_fd = None
            process.stop_watchdog(wd, fd)
            if self._log is not None:
                self._log.close()
                self._log = None
            process.unregister(self)

    def __enter__(self) -> "AgentProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
