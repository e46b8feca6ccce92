"""Files only their owner reads: directories 0700, files 0600, opened without following symlinks.

Recorded traffic, traces, engine logs and the head registry can hold a shop's
customers' words. Every writer of them goes through this module:

- ``private_dir`` creates a directory 0700 (missing parents too), tightens one
  this user owns to 0700, and refuses one owned by another user or writable by
  group or others (someone else could have planted files or links in it).
- ``open_private`` opens a file with ``O_NOFOLLOW``: a symlink in the file's
  place is refused instead of followed, so a link named like a log cannot make
  a writer truncate its target. A file it creates is 0600; one it reopens is
  tightened to 0600.
- ``write_private`` writes a whole file atomically (a 0600 temporary beside it,
  then a rename), so a reader never sees half of it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO, Any

DIR_MODE = 0o700
FILE_MODE = 0o600

# Python's open modes → os.open flags; "x": create, refuse an existing file
_FLAGS = {
    "r": os.O_RDONLY, "rb": os.O_RDONLY,
    "r+": os.O_RDWR, "rb+": os.O_RDWR, "r+b": os.O_RDWR,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL, "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
}


class UnsafePathError(PermissionError):
    """A directory or file that another user could read, replace or redirect: the message says what to do."""


def check_dir(path: Path, st: os.stat_result | None = None) -> None:
    """Refuse ``path`` when it is not a directory of this user's that only its owner can write."""
    st = st or os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        # a link to a directory: judge what it points at, and the link's owner
        if st.st_uid != os.geteuid():
            raise UnsafePathError(f"{path} is a symlink owned by another user (uid {st.st_uid}): "
                                  "give a directory of your own")
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(f"{path} is owned by another user (uid {st.st_uid}, you are {os.geteuid()}): "
                              "private files go into a directory of your own; give another path")
    if st.st_mode & 0o022:
        raise UnsafePathError(f"{path} can be written by other users (mode {stat.S_IMODE(st.st_mode):04o}): "
                              f"`chmod go-w {path}` or give a directory only you can write")


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory only this user can enter: created 0700 (with missing parents), an existing one
    of this user's tightened to 0700; refused (``UnsafePathError``) when another user owns it or others
    may write it."""
    path = Path(path).expanduser()
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            pass  # made by a concurrent writer; checked below
    st = os.lstat(path)
    check_dir(path, st)
    real = os.stat(path)
    if stat.S_IMODE(real.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def open_private(path: str | Path, mode: str = "ab", *, encoding: str | None = None,
                 buffering: int = -1) -> IO[Any]:
    """``open(path, mode)`` for a file only its owner reads: created 0600, never through a symlink.

    A symlink at ``path`` raises ``UnsafePathError``; an existing file owned by another user too.
    Text modes take ``encoding`` (UTF-8 by default)."""
    path = Path(path)
    binary = "b" in mode
    key = mode.replace("t", "")
    if key not in _FLAGS:
        raise ValueError(f"open_private: unsupported mode {mode!r}")
    flags = _FLAGS[key] | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symlink: cartspec does not write private data through links; "
                                  "remove it or give another path") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafePathError(f"{path} is owned by another user (uid {st.st_uid}): give a path of your own")
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path} is not a regular file")
        if stat.S_IMODE(st.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
        if binary:
            return os.fdopen(fd, mode, buffering=buffering)
        return os.fdopen(fd, mode, buffering=buffering, encoding=encoding or "utf-8")
    except BaseException:
        os.close(fd)
        raise


def write_private(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` as a 0600 file, atomically (a temporary beside it, then a rename)."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    with open_private(tmp, "xb") as fh:
        fh.write(raw)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path
