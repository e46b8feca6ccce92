"""Keeps the vLLM deployments behind the agent up: ``Keeper`` restarts one that died (crash, OOM kill).

The agent answers 503 meanwhile (or routes to the other deployment) and follows it back up through
its health probe. What a deployment is and how it stops lives with ``serving.server.VllmServer``;
this only decides when to call its ``restart()``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

from ..serving import process
from ..serving.server import DeploymentError

if TYPE_CHECKING:
    from ..serving.server import VllmServer

log = logging.getLogger("cartspec.agent")


class Keeper(threading.Thread):
    """Restarts a deployment that died, with a backoff per deployment while its restarts fail. One thread for
    all deployments: two vLLMs (re)starting at once on two cores would each take twice as long.
    ``servers``: ``VllmServer``s, or anything with their ``alive()``, ``restart()``, ``spec``, ``url`` and
    ``log_path``. ``say``: where restarts are reported (the CLI's console; the agent's log by default)."""

    def __init__(self, servers: "VllmServer | Sequence[VllmServer]", every_s: float = 2.0,
                 say: Callable[[str], None] = log.warning):
        super().__init__(daemon=True, name="vllm-keeper")
        self.servers = list(servers) if isinstance(servers, (list, tuple)) else [servers]
        self.every_s = every_s
        self.say = say
        self.stopping = threading.Event()
        self.restarts = 0
        self._retry_at = {id(s): 0.0 for s in self.servers}
        self._backoff = {id(s): 5.0 for s in self.servers}

    @property
    def server(self) -> "VllmServer":  # the one deployment of a single-deployment serve
        return self.servers[0]

    def run(self) -> None:
        while not self.stopping.wait(self.every_s):
            for server in self.servers:
                if self.stopping.is_set() or process.shutting_down():
                    return  # a deployment that exits while the program stops was stopped: no restart
                if server.alive():
                    self._backoff[id(server)] = 5.0
                elif time.monotonic() >= self._retry_at[id(server)]:
                    self._restart(server)

    def _restart(self, server: "VllmServer") -> None:
        self.say(f"vLLM {server.spec.label} exited; restarting it (log: {server.log_path})")
        try:
            server.restart()
            self.restarts += 1
            self.say(f"vLLM {server.spec.label} back at {server.url}")
        except DeploymentError as exc:
            if self.stopping.is_set() or process.shutting_down():
                return
            backoff = self._backoff[id(server)]
            self.say(f"restart of {server.spec.label} failed: {exc.reason}; next try in {backoff:.0f}s")
            # A deadline, not a sleep: the other deployment stays watched meanwhile.
            self._retry_at[id(server)] = time.monotonic() + backoff
            self._backoff[id(server)] = min(backoff * 2, 120.0)
