"""Recorded traffic: one JSON line per answered request, redacted before it is written.

``TrafficWriter`` appends ``TrafficRecord`` lines to rotating files
``traffic-YYYYMMDDTHHMMSS-<process id>.jsonl`` (UTC; a random id per process)
in a 0700 directory, 0600 each, flushing each line, so a killed agent loses at
most the line it was writing; a writer that opens the directory again truncates
such a torn last line in files no writer holds. Size and age limits prune the
oldest files. ``read_traffic`` reads a directory or one file back,
skipping torn or invalid lines; ``dedupe`` and ``split_by_time`` prepare
records for training a draft head on them.

Every record is redacted (``task.redact``) before it is written. The format is
described field by field in docs/traffic.md.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..private_files import UnsafePathError, open_private, private_dir
from .data import Request, Turn
from .redact import Redactor, compile_pattern
from .redact import DEFAULT_PHONE_REGIONS, check_phone_regions

FORMAT_VERSION = 1
FILE_GLOB = "traffic-*.jsonl"
# traffic-<UTC start>-<process id>[-<n>].jsonl; an older cartspec named its files by pid (up to 10 digits)
_FILE_NAME = re.compile(r"^traffic-(\d{8}T\d{6})-([0-9a-f]{16}|\d{1,10})(?:-(\d+))?\.jsonl$")
_LEGACY_ID_MAX = 10
MiB = 1 << 20
GiB = 1 << 30


class TrafficRecord(BaseModel):
    """One answered request, as one line of a traffic file. Fields a later version adds are ignored on read."""

    model_config = ConfigDict(extra="ignore")

    v: int = FORMAT_VERSION
    id: str
    ts: float = Field(description="unix time the answer was written")
    task: Literal["search", "support", "chat", "completion"] = Field(
        description="search and support: the commerce endpoints; chat: /v1/chat/completions (the client's "
                    "``messages``, ``query`` empty); completion: /v1/completions (its prompt in ``query``, no messages)")
    query: str
    history: list[Turn] = Field(default_factory=list)
    messages: list[dict[str, str]] = Field(description="the chat messages sent to the target")
    reply: str = Field(description="the target's reply text")
    temperature: float
    structured: bool = Field(description="constrained (JSON-schema) decoding on the answering call")
    route: str | None = None
    deployment: str | None = None
    head: str | None = None
    head_version: str | None = None
    gamma: int | None = None
    proposed: int = 0
    accepted: int = 0
    drafts: int = 0
    output_tokens: int = 0
    latency_ms: float = 0.0
    redactions: int = 0

    def request(self) -> Request:
        """The request to ask again or render again (the redacted words, as recorded)."""
        return Request(id=self.id, task=self.task, query=self.query, history=list(self.history))

    @property
    def tau(self) -> float | None:
        """Tokens per verify step on the drafted steps: 1 + accepted / drafts; None without drafts."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None


# --- configuration --------------------------------------------------------------------------------------------

class TrafficConfig(BaseModel):
    """Where and how much traffic is recorded. ``dir`` None (the default): nothing is recorded."""

    model_config = ConfigDict(extra="forbid")

    dir: Path | None = None
    max_file_bytes: int = Field(64 * MiB, ge=1, description="a line that would take a file past this starts a new file")
    max_total_bytes: int = Field(1 * GiB, ge=1, description="past this, the oldest files are deleted")
    max_age_days: float = Field(30.0, gt=0, description="files whose newest record is older than this are deleted")
    redact_defaults: bool = Field(True, description="mask e-mails, phones, cards, IBANs, national ids, order ids")
    redact_patterns: list[str] = Field(default_factory=list,
                                       description="more regexes to mask (with a group 'v': only that part)")
    redact_key: str | None = Field(None, description="key of the pseudonyms; unset: a random key per writer")
    redact_phone_regions: list[str] = Field(default_factory=lambda: list(DEFAULT_PHONE_REGIONS),
                                            description="countries (ISO 3166) whose national phone formats are masked")

    @field_validator("redact_patterns")
    @classmethod
    def _compile(cls, v: list[str]) -> list[str]:
        for p in v:
            compile_pattern(p)
        return v

    @field_validator("redact_phone_regions")
    @classmethod
    def _regions(cls, v: list[str]) -> list[str]:
        return list(check_phone_regions(v))

    @model_validator(mode="after")
    def _check(self) -> "TrafficConfig":
        if self.max_total_bytes < self.max_file_bytes:
            raise ValueError(f"max_total_bytes ({self.max_total_bytes}) must be at least max_file_bytes "
                             f"({self.max_file_bytes}): one full file must fit")
        return self

    @property
    def enabled(self) -> bool:
        return self.dir is not None


# --- files ----------------------------------------------------------------------------------------------------
#
# Each writer's file is named by this process's random id and held under an exclusive flock while it is
# written. A file whose lock can be taken is a leftover (its writer closed it or died): repaired and pruned.
# Replicas sharing a volume, each PID 1 in its container, get different ids and never take each other's live
# files for their own. Files, links and directories are opened through ``private_files``: never through a
# symlink, files 0600 in a 0700 directory.

_PROCESS_ID = ""


def _new_process_id() -> None:
    global _PROCESS_ID
    _PROCESS_ID = os.urandom(8).hex()


_new_process_id()
os.register_at_fork(after_in_child=_new_process_id)  # a forked worker writes files of its own

_OPEN_LOCK = threading.Lock()
# (st_dev, st_ino) of the files a TrafficWriter of this process is writing: where flock is emulated with
# per-process POSIX locks (NFS), a second lock by this process would succeed on its own live file
_OPEN_FILES: set[tuple[int, int]] = set()


def process_id() -> str:
    """The random id this process's traffic files are named by (16 hex digits; a new one after a fork)."""
    return _PROCESS_ID


def _try_lock(fd: int) -> bool:
    """Take the exclusive lock of a traffic file without waiting; False when a writer holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return False  # no locks on this filesystem: nothing says the file is a leftover, so leave it alone
    return True


def _same_file(path: Path, fd: int) -> bool:
    """``path`` still names the file open at ``fd`` (no one deleted or replaced it meanwhile)."""
    try:
        st, ft = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (ft.st_dev, ft.st_ino)


def _legacy_pid_live(path: Path) -> bool:
    """A file named by pid (an older cartspec's, which took no locks) while a process other than this one
    runs with that pid. This version never names a file by pid, so a file with this process's pid is an
    earlier process's leftover."""
    m = _FILE_NAME.match(path.name)
    if not m or len(m.group(2)) > _LEGACY_ID_MAX:
        return False
    pid = int(m.group(2))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid < (1 << 31)
    except OSError:
        return False
    return True


def _claim(path: Path) -> IO[bytes] | None:
    """``path`` opened read-write with its lock held, when it is a leftover no writer holds; else None (a live
    file, a symlink, a file of another user's, one that is gone). Close it to release the lock."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    with _OPEN_LOCK:
        mine = (st.st_dev, st.st_ino) in _OPEN_FILES
    if mine or _legacy_pid_live(path):  # decided before opening it: closing a descriptor of a file can drop
        return None                      # this process's lock on it where flock is emulated (NFS)
    try:
        fh = open_private(path, "rb+")
    except OSError:  # UnsafePathError (a link, another user's file) included
        return None
    try:
        if _try_lock(fh.fileno()) and _same_file(path, fh.fileno()):
            return fh
    except OSError:
        pass
    fh.close()
    return None


def _cut_torn_tail(fh: IO[bytes]) -> int:
    size = fh.seek(0, os.SEEK_END)
    if size == 0:
        return 0
    fh.seek(size - 1)
    if fh.read(1) == b"\n":
        return 0
    pos, chunk = size, 1 << 16
    keep = 0
    while pos > 0:
        start = max(0, pos - chunk)
        fh.seek(start)
        block = fh.read(pos - start)
        nl = block.rfind(b"\n")
        if nl >= 0:
            keep = start + nl + 1
            break
        pos = start
    fh.truncate(keep)
    fh.flush()
    os.fsync(fh.fileno())
    return size - keep


def repair_torn_tail(path: str | Path) -> int:
    """Truncate ``path`` after its last newline (a line torn by a kill); returns the bytes dropped.

    A symlink is refused (``UnsafePathError``), never followed; a file whose lock a writer holds is left
    alone (0): that writer may be in the middle of a line."""
    with open_private(path, "rb+") as fh:
        if not _try_lock(fh.fileno()):
            return 0
        return _cut_torn_tail(fh)


def _in_use(path: Path) -> bool:
    """Being written: its lock is held (by a writer of this process or of another), or it is an older
    version's file named by the pid of another running process. Symlinks and others' files count as in use:
    they are never touched."""
    fh = _claim(path)
    if fh is None:
        return True
    fh.close()
    return False


def _started(path: Path) -> tuple[str, int, str]:
    m = _FILE_NAME.match(path.name)
    return (m.group(1), int(m.group(3) or 0), path.name) if m else ("", 0, path.name)


def _plain_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def traffic_files(directory: str | Path) -> list[Path]:
    """The traffic files in ``directory``, in the order they were started (by the time in the name).
    Plain files only: a symlink named like a traffic file is not one."""
    return sorted((p for p in Path(directory).glob(FILE_GLOB) if _plain_file(p)), key=_started)


def newest_ts(path: Path, tail_bytes: int = 1 << 16) -> float:
    """The newest ``ts`` among the last lines of ``path`` (the file's modification time when none parses)."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - tail_bytes))
            tail = fh.read()
    except OSError:
        return 0.0
    best: float | None = None
    for line in tail.splitlines():
        try:
            ts = json.loads(line).get("ts")
        except (ValueError, AttributeError):
            continue
        if isinstance(ts, (int, float)):
            best = ts if best is None else max(best, ts)
    if best is None:
        try:
            return os.lstat(path).st_mtime
        except OSError:
            return 0.0
    return float(best)


@dataclass
class PruneReport:
    deleted: list[Path] = field(default_factory=list)
    bytes_deleted: int = 0


def _delete_leftover(path: Path) -> bool:
    """Unlink ``path`` while holding its lock, so a writer never loses a file it holds; False when it is live."""
    fh = _claim(path)
    if fh is None:
        return False
    with fh:
        try:
            os.unlink(path)  # the directory entry itself, the plain file _claim checked: never a link's target
        except FileNotFoundError:
            pass
    return True


def prune(directory: Path, max_total_bytes: int, max_age_days: float, *, reserve: int = 0,
          now: float | None = None) -> PruneReport:
    """Delete traffic files whose newest record is older than ``max_age_days``, then the oldest ones while the
    directory holds more than ``max_total_bytes - reserve`` (``reserve``: room kept for the file about to be
    written). Files being written are never deleted; they count in the total. Symlinks are neither counted
    nor deleted."""
    now = time.time() if now is None else now
    report = PruneReport()
    files = []
    for p in traffic_files(directory):
        try:
            size = os.lstat(p).st_size
        except OSError:
            continue
        files.append((newest_ts(p), _started(p), p, size, _in_use(p)))
    files.sort()
    total = sum(f[3] for f in files)
    cutoff = now - max_age_days * 86400.0
    for ts, _, p, size, busy in files:
        if busy:
            continue
        if ts < cutoff or total + reserve > max_total_bytes:
            try:
                if not _delete_leftover(p):
                    continue  # gone meanwhile, or no longer a leftover's plain file: not ours to delete
            except OSError:
                continue
            total -= size
            report.deleted.append(p)
            report.bytes_deleted += size
    return report


class TrafficWriter:
    """Appends redacted records to rotating files in ``config.dir``; thread-safe.

    The directory is made (or kept) 0700 and refused (``UnsafePathError``) when another user owns it or
    others may write it; files are created 0600, never through a symlink, and named by this process's random
    id (``process_id``). Each file is held under an exclusive ``flock`` while it is written: other writers,
    in this process or another on the same volume, leave it alone.

    Opening repairs torn last lines left in the directory by a killed writer (files whose lock is free) and
    prunes by the limits. Every ``write`` flushes its line; a line that would take
    the file past ``max_file_bytes`` starts a new file (a single longer line gets a
    file of its own). Before a file is started the limits are applied, keeping room
    for that file at its full size, so the directory stays under
    ``max_total_bytes`` (files of other running writers count in the total but
    are never deleted). Disk errors (a full disk) are raised by ``write``.
    """

    PRUNE_EVERY_S = 3600.0  # also prune this often while one file is being written (the age limit)

    def __init__(self, config: TrafficConfig, *, redactor: Redactor | None = None):
        if config.dir is None:
            raise ValueError("traffic recording is off (TrafficConfig.dir is None): give a directory to record into")
        self.config = config
        try:
            self.dir = private_dir(config.dir)
        except UnsafePathError as e:
            raise UnsafePathError(f"cannot record traffic into {config.dir}: {e}") from None
        except OSError as e:
            raise OSError(f"cannot create the traffic directory {config.dir}: {e}") from e
        self.redactor = redactor or Redactor(config.redact_patterns, config.redact_defaults, key=config.redact_key,
                                             phone_regions=config.redact_phone_regions)
        self._lock = threading.Lock()
        self._fh = None
        self._key: tuple[int, int] | None = None
        self.path: Path | None = None   # the file being written; None between files
        self._size = 0
        self._last_start = ("", -1)
        self._closed = False
        self.written = 0
        self.repaired: dict[Path, int] = {}
        for p in traffic_files(self.dir):
            fh = _claim(p)
            if fh is None:
                continue
            with fh:
                try:
                    dropped = _cut_torn_tail(fh)
                except OSError:
                    continue
            if dropped:
                self.repaired[p] = dropped
        self.pruned = self._prune()

    def _prune(self) -> PruneReport:
        self._last_prune = time.monotonic()
        return prune(self.dir, self.config.max_total_bytes, self.config.max_age_days,
                     reserve=self.config.max_file_bytes - self._size)

    def _new_file(self) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        ident = process_id()
        # a second file in the same second is "-1", "-2", ...: never a name this writer used (and pruned) before
        n = self._last_start[1] + 1 if self._last_start[0] == stamp else 0
        while True:
            name = f"traffic-{stamp}-{ident}.jsonl" if n == 0 else f"traffic-{stamp}-{ident}-{n}.jsonl"
            path = self.dir / name
            try:
                fh = open_private(path, "xb")  # O_EXCL: never an existing file, nor a symlink's target
            except FileExistsError:
                n += 1
                continue
            try:
                # waits only while a pruner that took the new, empty file for a leftover deletes it
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            except OSError as e:
                fh.close()
                raise OSError(f"cannot lock {path}: {e}; the traffic directory must be on a filesystem with "
                              "file locks (flock), so that writers sharing it leave each other's files alone") from e
            if not _same_file(path, fh.fileno()):
                fh.close()  # deleted before the lock was ours: start another
                n += 1
                continue
            break
        st = os.fstat(fh.fileno())
        self._key = (st.st_dev, st.st_ino)
        with _OPEN_LOCK:
            _OPEN_FILES.add(self._key)
        self._fh, self.path, self._size = fh, path, 0
        self._last_start = (stamp, n)

    def _close_file(self) -> None:
        if self._fh is not None:
            self._fh.close()  # releases its lock: from now on a leftover to other writers
            with _OPEN_LOCK:
                _OPEN_FILES.discard(self._key)
        self._fh, self.path, self._size, self._key = None, None, 0, None

    def write(self, rec: TrafficRecord) -> None:
        """Redact ``rec`` and append it as one flushed line; rotate and prune when the file is full."""
        line = (self.redactor.redact_record(rec).model_dump_json() + "\n").encode()
        with self._lock:
            if self._closed:
                raise RuntimeError("this TrafficWriter is closed")
            if self._fh is not None and self._size and self._size + len(line) > self.config.max_file_bytes:
                self._close_file()  # full: the line goes to a new file
            if self._fh is None:
                self._prune()
                self._new_file()
            elif time.monotonic() - self._last_prune > self.PRUNE_EVERY_S:
                self._prune()
            self._fh.write(line)
            self._fh.flush()
            self._size += len(line)
            self.written += 1

    def close(self) -> None:
        with self._lock:
            self._close_file()
            self._closed = True

    def __enter__(self) -> "TrafficWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- reading --------------------------------------------------------------------------------------------------

class TrafficScan(BaseModel):
    """What ``scan_traffic`` read: the records and how many lines it skipped (torn or invalid)."""

    records: list[TrafficRecord]
    files: list[Path]
    skipped: int = 0


def scan_traffic(path: str | Path, since: float | None = None, until: float | None = None) -> TrafficScan:
    """Like ``read_traffic``, and says which files it read and how many lines it skipped."""
    path = Path(path).expanduser()
    if path.is_dir():
        files = traffic_files(path)
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"no traffic at {path}: give the directory `serve --record-traffic` wrote "
                                "or one of its traffic-*.jsonl files")
    records: list[TrafficRecord] = []
    skipped = 0
    for f in files:
        try:
            data = f.read_bytes()
        except FileNotFoundError:
            continue  # pruned while reading
        for raw in data.split(b"\n"):
            if not raw.strip():
                continue
            try:
                rec = TrafficRecord.model_validate_json(raw)
            except ValueError:
                skipped += 1
                continue
            if since is not None and rec.ts < since:
                continue
            if until is not None and rec.ts >= until:
                continue
            records.append(rec)
    records.sort(key=lambda r: r.ts)
    return TrafficScan(records=records, files=files, skipped=skipped)


def read_traffic(path: str | Path, since: float | None = None, until: float | None = None) -> list[TrafficRecord]:
    """The records of a traffic directory (every traffic-*.jsonl in it) or of one file, sorted by ``ts``;
    ``since`` <= ts < ``until``. Torn or invalid lines are skipped."""
    return scan_traffic(path, since, until).records


# --- preparing records for training ---------------------------------------------------------------------------

def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


def request_key(rec: TrafficRecord) -> tuple:
    """What makes two records the same request: task, query and history, whitespace and case ignored; for a
    chat, its messages (the system prompt included)."""
    key = (rec.task, _norm(rec.query), tuple((t.role, _norm(t.content)) for t in rec.history))
    if rec.task == "chat":
        key += tuple((m.get("role"), _norm(m.get("content", ""))) for m in rec.messages)
    return key


def dedupe(records: Iterable[TrafficRecord]) -> list[TrafficRecord]:
    """One record per request (``request_key``), the latest (by ts; on a tie the later in the input); sorted by ts."""
    latest: dict[tuple, TrafficRecord] = {}
    for rec in records:
        k = request_key(rec)
        prev = latest.get(k)
        if prev is None or rec.ts >= prev.ts:
            latest[k] = rec
    return sorted(latest.values(), key=lambda r: r.ts)


def split_by_time(records: Iterable[TrafficRecord], held_out: float) -> tuple[list[TrafficRecord], list[TrafficRecord]]:
    """(train, held_out): the most recent ``held_out`` share of the records (by ts) is held out.

    With at least two records and a share above 0, each side keeps at least one.
    """
    if not 0 <= held_out < 1:
        raise ValueError(f"held_out must be a share in [0, 1), got {held_out}")
    ordered = sorted(records, key=lambda r: r.ts)
    n = len(ordered)
    n_held = round(n * held_out)
    if held_out > 0 and n >= 2:
        n_held = min(max(n_held, 1), n - 1)
    return ordered[:n - n_held], ordered[n - n_held:]
