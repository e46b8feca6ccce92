"""A child process this process owns, with every process it spawns: the pieces ``VllmServer`` and the
agent's ``AgentProcess`` are built from.

The child runs in its own session, so its group holds everything it spawns (vLLM's engine-core
workers, the agent's own vLLMs) and ``stop_group`` ends them all. A caller can die without running
any Python (SIGKILL, the OOM killer, a segfault): for that each child gets a watchdog, a tiny process
in its own session that holds the read end of a pipe whose write end only the caller holds. The
kernel closes that end however the caller dies; the watchdog sees EOF and kills the whole group.
``PR_SET_PDEATHSIG`` would only reach the direct child, not the processes it spawns.

Owners register while their child runs: ``stop_all`` (at interpreter exit, and from the signal
handlers ``serving.server.install_signal_handlers`` installs) stops every one still registered. Those two
first call ``begin_shutdown``: from then on ``shutting_down()`` is true and nothing starts a child again (a
supervisor that saw its vLLM die under the shutdown would otherwise restart it, truncating its log).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
from typing import Protocol

WATCHDOG = r"""
import os, select, signal, sys, time
fd, pgid = int(sys.argv[1]), int(sys.argv[2])
signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C meant for the caller is not for us
signal.signal(signal.SIGHUP, signal.SIG_IGN)

def group_alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True

while group_alive():
    ready, _, _ = select.select([fd], [], [], 1.0)
    if ready and not os.read(fd, 1):           # EOF: the caller is gone, however it died
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + grace
            while time.monotonic() < end and group_alive():
                time.sleep(0.2)
        break
"""


class Owner(Protocol):
    def stop(self, grace: float = ...) -> None: ...


# Strong references: an owner whose object the caller dropped must still be stopped at exit (a WeakSet
# would forget it and leave its processes running).
_LIVE: "set[Owner]" = set()


def register(owner: Owner) -> None:
    _LIVE.add(owner)


def unregister(owner: Owner) -> None:
    _LIVE.discard(owner)


_SHUTDOWN = threading.Event()


def begin_shutdown() -> None:
    """This program is stopping (a signal, interpreter exit): ``shutting_down()`` is true from now on."""
    _SHUTDOWN.set()


def shutting_down() -> bool:
    """True once the program began to stop: a child that exits now was stopped, not crashed."""
    return _SHUTDOWN.is_set()


def stop_all(grace: float = 5.0) -> None:
    """Stop every registered owner's processes."""
    for owner in list(_LIVE):
        owner.stop(grace=grace)


def _stop_all_at_exit() -> None:
    begin_shutdown()
    stop_all()


def start_watchdog(pgid: int) -> tuple[subprocess.Popen, int]:
    """A watchdog for process group ``pgid``, and the write end of its pipe: close it (``stop_watchdog``)
    and the watchdog exits; die with it open and the watchdog kills the group."""
    read_fd, write_fd = os.pipe()  # both non-inheritable: the child never holds the write end
    try:
        watchdog = subprocess.Popen(
            [sys.executable, "-S", "-c", WATCHDOG, str(read_fd), str(pgid)], pass_fds=(read_fd,),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    return watchdog, write_fd


def stop_watchdog(watchdog: subprocess.Popen | None, fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # EOF: the watchdog finds the group gone and exits
    if watchdog is not None:
        try:
            watchdog.wait(3)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            watchdog.wait()


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to ``proc``'s whole group, ``grace`` seconds for it to go, then SIGKILL to whatever is left."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:  # the group may outlive its leader: make sure no child of it is left
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def group_pids(proc: subprocess.Popen | None) -> list[int]:
    """Every live process of ``proc``'s group (the child and what it spawned)."""
    if proc is None:
        return []
    import psutil

    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return out


# At import: an exit hook takes nothing from the host program (unlike signal handlers).
atexit.register(_stop_all_at_exit)
