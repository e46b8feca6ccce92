"""Versioned draft heads: ``$CARTSPEC_HOME/heads/NAME/`` keeps every version of a head and one ``current``.

Layout of a registry::

    NAME/versions/v0001/      the head's files (config.json, model.safetensors, PROVENANCE.md, ...)
                              + version.json (a HeadVersion) + gate.json (the offline gate's decision, if any)
    NAME/current              the current version's name, one line, replaced atomically
    NAME/events.jsonl         one line per add / promote / rollback / reject: ts, event, version,
                              from / to (the current version before / after), reason, figures

A registry exists iff ``NAME/versions/`` exists: other directories under ``heads/`` (the plain head
directories ``draft train`` writes there) are ordinary head paths. The ``current`` file is the
authority on which version is current; the ``status`` recorded in each version.json follows it (a
crash between the two writes is read back consistently). A version directory is a normal head
directory, so serving checks it against the served target (``check_head``) like any other head.

Every version records the target digest its config.json names. ``add``, ``promote`` and ``rollback``
refuse (``HeadPinError``) a head pinned to another target than the current version, unless forced.

A version whose version.json cannot be read or parsed is corrupt: ``versions`` leaves it out, ``scan`` lists
it (a ``CorruptVersion`` with the reason), and ``get`` / ``current`` raise ``CorruptVersionError`` for it.
The registry's directories are 0700 and its files 0600 (``private_files``): a head's provenance names the
traffic it was trained on.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..paths import home
from ..private_files import open_private, private_dir, write_private
from ..task.data import read_jsonl
from .convert import ModelNotFound

Status = Literal["candidate", "current", "retired", "rejected"]
NAME_MAX = 64
# matched with fullmatch: "$" alone would let a trailing newline through ("shop\n")
NAME_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{NAME_MAX - 1}}}")
VERSION_RE = re.compile(r"v?(\d{1,9})")
VERSION_FILE = "version.json"
GATE_FILE = "gate.json"
_NOT_COPIED = (VERSION_FILE, GATE_FILE, "__pycache__", ".*")


class HeadRegistryError(ValueError):
    """A registry operation that cannot be done as asked (the message says why and what to do)."""


class HeadPinError(HeadRegistryError):
    """A head pinned to another target digest than the registry's current version."""


class CorruptVersionError(HeadRegistryError, ModelNotFound):
    """A version whose version.json is missing, unreadable or invalid: it cannot be served or changed (a
    ModelNotFound too, so that commands resolving a head report it as they report a missing one)."""


class HeadVersion(BaseModel):
    """One version of a registered head, as kept in its ``version.json``."""

    model_config = ConfigDict(extra="ignore")

    name: str
    version: str
    path: Path
    created: float
    parent: str | None = None
    target_digest: str | None = None
    target_name: str | None = None
    provenance: dict[str, Any] = Field(default_factory=dict)
    status: Status = "candidate"

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


class CorruptVersion(BaseModel):
    """A version directory whose version.json cannot be loaded, and why."""

    name: str
    version: str
    path: Path
    reason: str
    status: Literal["corrupt"] = "corrupt"

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def error(self) -> CorruptVersionError:
        return CorruptVersionError(
            f"{self.ref} is corrupt ({self.reason}): restore {self.path / VERSION_FILE} from a backup, or remove "
            f"{self.path} (the other versions are unaffected; see `cartspec heads list {self.name}`)")


def head_target(head_dir: Path) -> dict[str, Any] | None:
    """What a head says about the target it was trained for (``digest``, ``name``), if anything (its
    ``config.json``'s ``cartspec.target``; ``model.registry`` checks it against the served model)."""
    conf = json.loads((Path(head_dir) / "config.json").read_text())
    return (conf.get("cartspec") or {}).get("target")


def default_root() -> Path:
    return home() / "heads"


def shown(text: str, limit: int = 40) -> str:
    """``text`` quoted for a one-line message, its middle elided when long (a 10,000-character argument)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit - 8]!r}... ({len(text)} characters)"


def valid_name(name: str) -> bool:
    return bool(NAME_RE.fullmatch(name))


def check_name(name: str) -> str:
    """``name`` when it is a valid registry name, else HeadRegistryError saying what a name may be."""
    if not valid_name(name):
        raise HeadRegistryError(f"{shown(name)} is not a head registry name: 1 to {NAME_MAX} characters, letters, "
                                "digits, '.', '_', '-', starting with a letter or digit (no spaces, newlines, "
                                "'@' or '/')")
    return name


def normalize_version(version: str) -> str:
    """``v2``, ``2``, ``v0002`` -> ``v0002``; raises HeadRegistryError for anything else."""
    m = VERSION_RE.fullmatch(version)
    if not m:
        raise HeadRegistryError(f"{shown(version)} is not a head version: versions are named v0001, v0002, ...")
    return f"v{int(m.group(1)):04d}"


def parse_ref(ref: str) -> tuple[str, str | None]:
    """``NAME@v0002`` -> (NAME, "v0002"); ``NAME`` -> (NAME, None). ``NAME@2`` and ``NAME@v2`` mean v0002."""
    name, sep, version = ref.partition("@")
    if not sep:
        return name, None
    return name, normalize_version(version)


def _copy_private(src: Path, dst: Path) -> None:
    """Copy a head directory's files into ``dst`` as 0600 files in 0700 directories (``shutil.copytree`` would
    keep the source's modes). A version's own records (version.json, gate.json) and hidden files are left out."""
    private_dir(dst)
    names = os.listdir(src)
    skipped = shutil.ignore_patterns(*_NOT_COPIED)(str(src), names)
    for entry in sorted(set(names) - skipped):
        s, d = src / entry, dst / entry
        if s.is_dir():
            _copy_private(s, d)
            continue
        with s.open("rb") as fin, open_private(d, "xb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)


def _load_reason(exc: Exception) -> str:
    """Why a version.json did not load, in one line."""
    if isinstance(exc, ValidationError):
        errs = exc.errors()
        parts = [": ".join(filter(None, (".".join(map(str, e["loc"])), e["msg"]))) for e in errs[:3]]
        more = f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""
        return "invalid version.json: " + "; ".join(parts) + more
    if isinstance(exc, FileNotFoundError):
        return "no version.json"
    if isinstance(exc, OSError):
        return f"version.json unreadable: {exc.strerror or exc}"
    return f"invalid version.json: {exc}"


class HeadRegistry:
    """The versions of one named head under ``root / name``."""

    def __init__(self, name: str, root: Path | None = None):
        self.name = check_name(name)
        self.root = Path(root) if root is not None else default_root()
        self.dir = self.root / name

    # --- reading ---------------------------------------------------------------------------------
    @property
    def versions_dir(self) -> Path:
        return self.dir / "versions"

    @property
    def events_path(self) -> Path:
        return self.dir / "events.jsonl"

    def exists(self) -> bool:
        return self.versions_dir.is_dir()

    def _current_name(self) -> str | None:
        path = self.dir / "current"
        if not path.exists():
            return None
        name = path.read_text().strip()
        # only a version's name: a hand-edited "../x" must not lead outside versions/
        return name if VERSION_RE.fullmatch(name) else None

    def _read(self, vdir: Path, current: str | None) -> HeadVersion | CorruptVersion:
        """A version directory's HeadVersion, or a CorruptVersion saying why its version.json did not load."""
        try:
            v = HeadVersion.model_validate_json((vdir / VERSION_FILE).read_bytes())
        except (OSError, ValueError) as exc:  # ValidationError is a ValueError
            return CorruptVersion(name=self.name, version=vdir.name, path=vdir, reason=_load_reason(exc))
        v = v.model_copy(update={"path": vdir, "name": self.name, "version": vdir.name})
        if v.version == current and v.status != "current":
            v = v.model_copy(update={"status": "current"})
        elif v.status == "current" and v.version != current:
            v = v.model_copy(update={"status": "retired"})
        return v

    def _load(self, vdir: Path, current: str | None) -> HeadVersion:
        v = self._read(vdir, current)
        if isinstance(v, CorruptVersion):
            raise v.error()
        return v

    def scan(self) -> list[HeadVersion | CorruptVersion]:
        """Every version directory, oldest first: corrupt ones as CorruptVersion (for listing them)."""
        if not self.exists():
            return []
        current = self._current_name()
        return [self._read(d, current) for d in sorted(self.versions_dir.iterdir())
                if VERSION_RE.fullmatch(d.name) and d.is_dir()]

    def versions(self) -> list[HeadVersion]:
        """Every version that loads, oldest first (corrupt ones are left out: see ``scan``)."""
        return [v for v in self.scan() if isinstance(v, HeadVersion)]

    def get(self, version: str) -> HeadVersion:
        """One version (``v2`` / ``v0002`` / ``NAME@v0002``); ModelNotFound when there is none."""
        if "@" in version:
            name, ver = parse_ref(version)
            if name != self.name:
                raise HeadRegistryError(f"{version!r} names the registry {name!r}, not {self.name!r}")
            version = ver or ""
        version = normalize_version(version)
        vdir = self.versions_dir / version
        if not vdir.is_dir():
            known = ", ".join(v.version for v in self.scan()) or "none"
            raise ModelNotFound(f"the head registry {self.name!r} ({self.dir}) has no version {version} "
                                f"(versions: {known}); see `cartspec heads list {self.name}`")
        return self._load(vdir, self._current_name())

    def current(self) -> HeadVersion | None:
        """The current version; None when there is none. CorruptVersionError when it is corrupt."""
        name = self._current_name()
        if name is None or not (self.versions_dir / name).is_dir():
            return None
        return self._load(self.versions_dir / name, name)

    def events(self) -> list[dict[str, Any]]:
        """Every event, oldest first (a torn last line, from a crash while writing it, is skipped)."""
        return read_jsonl(self.events_path)

    def gate(self, version: str) -> dict[str, Any] | None:
        """The offline gate's decision written beside a version, if any; HeadRegistryError when it is corrupt."""
        path = self.get(version).path / GATE_FILE
        if not path.exists():
            return None
        try:
            return json.loads(path.read_bytes())
        except ValueError as exc:
            raise HeadRegistryError(f"{path} is not valid JSON ({exc}): run `cartspec draft gate` again") from None

    # --- writing ---------------------------------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[None]:
        private_dir(self.dir)
        with open_private(self.dir / ".lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _save(self, v: HeadVersion) -> None:
        write_private(v.path / VERSION_FILE, v.model_dump_json(indent=2) + "\n")

    def _set_current(self, version: str) -> None:
        write_private(self.dir / "current", version + "\n")

    def _event(self, event: str, version: str, before: str | None, after: str | None, reason: str,
               figures: dict[str, Any] | None, **extra: Any) -> None:
        rec = {"ts": time.time(), "event": event, "version": version, "from": before, "to": after,
               "reason": reason, "figures": figures or {}, **extra}
        self._repair_events()
        with open_private(self.events_path, "a") as fh:
            fh.write(json.dumps(rec, default=str) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _repair_events(self) -> None:
        """Drop a torn last line (a crash mid-write) so the next event starts on a line of its own."""
        path = self.events_path
        if not path.exists() or path.stat().st_size == 0:
            return
        data = path.read_bytes()
        if data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        with open_private(path, "r+b") as fh:
            fh.truncate(cut)

    def _check_pin(self, digest: str | None, what: str, force: bool, registered: bool = False) -> None:
        """Refuse a head pinned to another target than the current version's. ``registered``: ``what`` is a
        version of this registry (promote, rollback), not a head being added."""
        if force:
            return
        cur = self.current()
        if cur is None or not cur.target_digest or digest == cur.target_digest:
            return
        if digest is None:
            raise HeadPinError(
                f"{what} records no target digest (config.json has no cartspec.target.digest), while "
                f"{cur.ref} is pinned to target {cur.target_digest} ({cur.target_name or '?'}): it cannot be "
                "checked against the served model. Train it with `cartspec draft train` or `cartspec draft "
                "refresh` (they record the target), or pass --force")
        fix = (f"make current a version pinned to {cur.target_digest} (see `cartspec heads list {self.name}`)"
               if registered else "register it under another name (`cartspec heads add OTHER_NAME ...`)")
        raise HeadPinError(
            f"{what} is pinned to target {digest} but the current version of the registry {self.name!r}, {cur.ref}, "
            f"is pinned to target {cur.target_digest} ({cur.target_name or '?'}): a head trained for another "
            "target or adapter drafts for a model this registry does not serve, and `cartspec serve` would refuse "
            f"it. {fix[0].upper()}{fix[1:]}, train one for target {cur.target_digest}, or pass --force if the "
            "served target has changed")

    def _check_can_become_current(self, v: HeadVersion, action: str, force: bool) -> None:
        """What ``promote`` and ``rollback`` both refuse unless forced: a rejected version, and one pinned to
        another target than the current version (``serve`` would refuse it as a head for the served model).
        ``action``: "promote it" / "roll back to it", for the message."""
        if v.status == "rejected" and not force:
            raise HeadRegistryError(f"{v.ref} was rejected ({self._last_reason(v.version, 'reject')}); "
                                    f"pass --force to {action} anyway")
        self._check_pin(v.target_digest, v.ref, force, registered=True)

    def _next_version(self) -> str:
        # corrupt version directories keep their number: a new version never takes the place of one
        nums = [int(m.group(1)) for d in self.versions_dir.iterdir() if (m := VERSION_RE.fullmatch(d.name))] \
            if self.versions_dir.exists() else []
        return f"v{max(nums, default=0) + 1:04d}"

    def add(self, head_dir: Path, *, parent: str | None = None, provenance: dict[str, Any] | None = None,
            status: Status = "candidate", force: bool = False) -> HeadVersion:
        """Copy a head directory into a new version. The first version of a registry becomes current;
        ``status="current"`` makes this one current (as ``promote`` would). Refuses (HeadPinError) a head
        pinned to another target than the current version, unless ``force``."""
        head_dir = Path(head_dir)
        if not (head_dir / "config.json").is_file():
            raise ModelNotFound(f"{head_dir} is not a draft head directory (no config.json)")
        if status not in ("candidate", "current"):
            raise HeadRegistryError(f"a version is added as 'candidate' or 'current', not {status!r}")
        rec = head_target(head_dir) or {}
        digest, target_name = rec.get("digest"), rec.get("name")
        if parent is not None and "@" in parent:
            pname, pver = parse_ref(parent)
            parent = pver if pname == self.name and pver else parent
        with self._locked():
            self._check_pin(digest, f"the head {head_dir}", force)
            private_dir(self.versions_dir)
            version = self._next_version()
            tmp = self.versions_dir / f".{version}.{os.getpid()}.tmp"
            if tmp.exists():
                shutil.rmtree(tmp)
            _copy_private(head_dir, tmp)
            before = self.current()
            make_current = before is None or status == "current"
            prov = {"source": str(head_dir.resolve()), **(provenance or {})}
            v = HeadVersion(name=self.name, version=version, path=self.versions_dir / version, created=time.time(),
                            parent=parent, target_digest=digest, target_name=target_name, provenance=prov,
                            status="current" if make_current else "candidate")
            write_private(tmp / VERSION_FILE, v.model_dump_json(indent=2) + "\n")
            os.rename(tmp, v.path)
            if make_current:
                if before is not None:
                    self._save(before.model_copy(update={"status": "retired"}))
                self._set_current(version)
            after = version if make_current else (before.version if before else None)
            self._event("add", version, before.version if before else None, after,
                        reason=str(prov.get("command") or f"added from {head_dir}"), figures=None,
                        source=prov["source"], target_digest=digest)
        return v

    def promote(self, version: str, *, reason: str, figures: dict[str, Any] | None = None,
                force: bool = False) -> HeadVersion:
        """Make ``version`` current; the previous current becomes "retired". Refuses a rejected version
        and one pinned to another target than current's (HeadPinError), unless ``force``. Promoting the
        current version changes nothing."""
        with self._locked():
            v = self.get(version)
            before = self.current()
            if before is not None and before.version == v.version:
                return v
            self._check_can_become_current(v, "promote it", force)
            v = self._make_current(v, before, "promote", reason, figures, forced=force or None)
        return v

    def _make_current(self, v: HeadVersion, before: HeadVersion | None, event: str, reason: str,
                      figures: dict[str, Any] | None, **extra: Any) -> HeadVersion:
        v = v.model_copy(update={"status": "current"})
        self._set_current(v.version)
        self._save(v)
        if before is not None:
            self._save(before.model_copy(update={"status": "retired"}))
        self._event(event, v.version, before.version if before else None, v.version, reason, figures,
                    **{k: x for k, x in extra.items() if x is not None})
        return v

    def _history(self) -> list[str]:
        """The stack of current versions as the events left it: promote pushes, rollback pops."""
        stack: list[str] = []
        for ev in self.events():
            to, kind = ev.get("to"), ev.get("event")
            if not to or to == ev.get("from"):
                continue
            if kind in ("add", "promote"):
                stack.append(to)
            elif kind == "rollback":
                if stack:
                    stack.pop()
                if to in stack:
                    del stack[len(stack) - stack[::-1].index(to):]
                else:
                    stack.append(to)
        return stack

    def previous(self) -> str | None:
        """The version a rollback without ``to`` goes back to: the one current before the current one."""
        cur = self._current_name()
        stack = self._history()
        while stack and stack[-1] == cur:
            stack.pop()
        return stack[-1] if stack else None

    def rollback(self, *, reason: str, figures: dict[str, Any] | None = None, to: str | None = None,
                 force: bool = False) -> HeadVersion:
        """Make the previous current version (or ``to``) current again; the rolled-back one becomes "retired".
        Refuses what ``promote`` refuses (a rejected version, one pinned to another target), unless ``force``."""
        with self._locked():
            before = self.current()
            if before is None:
                raise HeadRegistryError(f"the head registry {self.name!r} has no current version to roll back")
            target = to if to is not None else self.previous()
            if target is None:
                raise HeadRegistryError(f"{before.ref} has no previous current version to roll back to: name one "
                                        f"with --to vN (see `cartspec heads list {self.name}`)")
            v = self.get(target)
            if v.version == before.version:
                raise HeadRegistryError(f"{v.ref} is already current")
            self._check_can_become_current(v, "roll back to it", force)
            return self._make_current(v, before, "rollback", reason, figures, forced=force or None)

    def reject(self, version: str, *, reason: str, figures: dict[str, Any] | None = None) -> HeadVersion:
        """Mark a candidate "rejected" (turned down by the canary or the gate): promote refuses it after."""
        with self._locked():
            v = self.get(version)
            if v.status == "current":
                raise HeadRegistryError(f"{v.ref} is current: roll it back (`cartspec heads rollback {self.name}`) "
                                        "instead of rejecting it")
            v = v.model_copy(update={"status": "rejected"})
            self._save(v)
            cur = self._current_name()
            self._event("reject", v.version, cur, cur, reason, figures)
        return v

    def write_gate(self, version: str, decision: dict[str, Any]) -> Path:
        """Write the offline gate's decision (and its figures) as gate.json beside the version."""
        path = self.get(version).path / GATE_FILE
        write_private(path, json.dumps(decision, indent=2, default=str) + "\n")
        return path

    def _last_reason(self, version: str, event: str) -> str:
        for ev in reversed(self.events()):
            if ev.get("version") == version and ev.get("event") == event:
                return str(ev.get("reason") or "no reason recorded")
        return "no reason recorded"


def resolve_registered(ref: str, root: Path | None = None) -> HeadVersion | None:
    """``NAME`` -> the registry's current version, ``NAME@vN`` -> that version; None when ``NAME`` is
    not a registry. Raises ModelNotFound for a missing version, or a registry without a current one."""
    if "/" in ref or os.sep in ref:
        return None
    try:
        name, version = parse_ref(ref)
    except HeadRegistryError:
        return None
    if not valid_name(name):
        return None
    reg = HeadRegistry(name, root)
    if not reg.exists():
        return None
    if version is not None:
        return reg.get(version)
    cur = reg.current()
    if cur is None:
        raise ModelNotFound(f"the head registry {name!r} ({reg.dir}) has no current version: promote one with "
                            f"`cartspec heads promote {name}@vN`")
    return cur


def version_info(head_dir: Path) -> HeadVersion | None:
    """The HeadVersion of a registry version directory, else None."""
    head_dir = Path(head_dir)
    path = head_dir / VERSION_FILE
    if not path.is_file() or head_dir.parent.name != "versions":
        return None
    try:
        v = HeadVersion.model_validate_json(path.read_bytes())
    except (OSError, ValueError):  # a corrupt version.json: not a version this can name
        return None
    if v.version != head_dir.name:
        return None
    return v.model_copy(update={"path": head_dir})


def version_of(head_dir: Path | str | None) -> str | None:
    """``NAME@v0002`` when ``head_dir`` is a registry version's directory, else None."""
    if head_dir is None:
        return None
    v = version_info(Path(head_dir))
    return v.ref if v else None
