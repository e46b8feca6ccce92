"""Recorded traffic: one JSON line per answered request, redacted before it is written.

``TrafficWriter`` appends ``TrafficRecord`` lines to rotating files
``traffic-YYYYMMDDTHHMMSS-<pid>.jsonl`` (UTC) in one directory, flushing each
line, so a killed agent loses at most the line it was writing; a writer that
opens the directory again truncates such a torn last line. Size and age limits
prune the oldest files. ``read_traffic`` reads a directory or one file back,
skipping torn or invalid lines; ``dedupe`` and ``split_by_time`` prepare
records for training a draft head on them.

Every record is redacted (``task.redact``) before it is written. The format is
described field by field in docs/traffic.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .data import Request, Turn
from .redact import DEFAULT_PATTERNS, Redactor, compile_pattern  # noqa: F401  (re-exported)

FORMAT_VERSION = 1
FILE_GLOB = "traffic-*.jsonl"
_FILE_NAME = re.compile(r"^traffic-(\d{8}T\d{6})-(\d+)(?:-(\d+))?\.jsonl$")
MiB = 1 << 20
GiB = 1 << 30


class TrafficRecord(BaseModel):
    """One answered request, as one line of a traffic file. Fields a later version adds are ignored on read."""

    model_config = ConfigDict(extra="ignore")

    v: int = FORMAT_VERSION
    id: str
    ts: float = Field(description="unix time the answer was written")
    task: Literal["search", "support"]
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
    redact_defaults: bool = Field(True, description="mask order ids, e-mail addresses and phone numbers")
    redact_patterns: list[str] = Field(default_factory=list,
                                       description="more regexes to mask (with a group 'v': only that part)")
    redact_key: str | None = Field(None, description="key of the pseudonyms; unset: a random key per writer")

    @field_validator("redact_patterns")
    @classmethod
    def _compile(cls, v: list[str]) -> list[str]:
        for p in v:
            compile_pattern(p)
        return v

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

_OPEN_LOCK = threading.Lock()
_OPEN_FILES: set[Path] = set()  # files a TrafficWriter of this process is writing


def repair_torn_tail(path: str | Path) -> int:
    """Truncate ``path`` after its last newline (a line torn by a kill); returns the bytes dropped."""
    path = Path(path)
    with path.open("rb+") as fh:
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


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process's files that no writer of it holds are left over from an earlier process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid < (1 << 31)
    except OSError:
        return False
    return True


def _in_use(path: Path) -> bool:
    """Being written: by a writer of this process, or named after another process that is still running."""
    with _OPEN_LOCK:
        if path.resolve() in _OPEN_FILES:
            return True
    m = _FILE_NAME.match(path.name)
    return bool(m) and _pid_alive(int(m.group(2)))


def _started(path: Path) -> tuple[str, int, str]:
    m = _FILE_NAME.match(path.name)
    return (m.group(1), int(m.group(3) or 0), path.name) if m else ("", 0, path.name)


def traffic_files(directory: str | Path) -> list[Path]:
    """The traffic files in ``directory``, in the order they were started (by the time in the name)."""
    return sorted((p for p in Path(directory).glob(FILE_GLOB) if p.is_file()), key=_started)


def newest_ts(path: Path, tail_bytes: int = 1 << 16) -> float:
    """The newest ``ts`` among the last lines of ``path`` (the file's modification time when none parses)."""
    try:
        with path.open("rb") as fh:
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
            return path.stat().st_mtime
        except OSError:
            return 0.0
    return float(best)


@dataclass
class PruneReport:
    deleted: list[Path] = field(default_factory=list)
    bytes_deleted: int = 0


def prune(directory: Path, max_total_bytes: int, max_age_days: float, *, reserve: int = 0,
          now: float | None = None) -> PruneReport:
    """Delete traffic files whose newest record is older than ``max_age_days``, then the oldest ones while the
    directory holds more than ``max_total_bytes - reserve`` (``reserve``: room kept for the file about to be
    written). Files being written are never deleted; they count in the total."""
    now = time.time() if now is None else now
    report = PruneReport()
    files = []
    for p in traffic_files(directory):
        try:
            size = p.stat().st_size
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
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            total -= size
            report.deleted.append(p)
            report.bytes_deleted += size
    return report


class TrafficWriter:
    """Appends redacted records to rotating files in ``config.dir``; thread-safe.

    Opening repairs torn last lines left in the directory by a killed writer and
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
        self.dir = Path(config.dir).expanduser()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"cannot create the traffic directory {self.dir}: {e}") from e
        self.redactor = redactor or Redactor(config.redact_patterns, config.redact_defaults, key=config.redact_key)
        self._lock = threading.Lock()
        self._fh = None
        self.path: Path | None = None   # the file being written; None between files
        self._size = 0
        self._last_start = ("", -1)
        self._closed = False
        self.written = 0
        self.repaired: dict[Path, int] = {}
        for p in traffic_files(self.dir):
            if _in_use(p):
                continue
            try:
                dropped = repair_torn_tail(p)
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
        pid = os.getpid()
        # a second file in the same second is "-1", "-2", ...: never a name this writer used (and pruned) before
        n = self._last_start[1] + 1 if self._last_start[0] == stamp else 0
        while True:
            name = f"traffic-{stamp}-{pid}.jsonl" if n == 0 else f"traffic-{stamp}-{pid}-{n}.jsonl"
            path = self.dir / name
            try:
                fh = path.open("xb")
            except FileExistsError:
                n += 1
                continue
            break
        with _OPEN_LOCK:
            _OPEN_FILES.add(path.resolve())
        self._fh, self.path, self._size = fh, path, 0
        self._last_start = (stamp, n)

    def _close_file(self) -> None:
        if self._fh is not None:
            self._fh.close()
            with _OPEN_LOCK:
                _OPEN_FILES.discard(self.path.resolve())
        self._fh, self.path, self._size = None, None, 0

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
    """What makes two records the same request: task, query and history, whitespace and case ignored."""
    return (rec.task, _norm(rec.query), tuple((t.role, _norm(t.content)) for t in rec.history))


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
