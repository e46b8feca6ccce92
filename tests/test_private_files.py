"""``cartspec.private_files``: directories only their owner enters, files only their owner reads, never a write
through a symlink."""

from __future__ import annotations

import os
import stat

import pytest

from cartspec.private_files import UnsafePathError, check_dir, open_private, private_dir, write_private


def _mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.fixture
def open_umask():
    """A umask that would leave everything open: the modes must not depend on the caller's."""
    old = os.umask(0)
    yield
    os.umask(old)


@pytest.fixture
def another_user(monkeypatch):
    """This process seen as another user: everything under tmp_path is then someone else's."""
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)


# --- directories ----------------------------------------------------------------------------------------------

def test_private_dir_creates_it_and_missing_parents_0700(tmp_path, open_umask):
    d = private_dir(tmp_path / "a" / "b" / "c")
    assert d == tmp_path / "a" / "b" / "c" and d.is_dir()
    assert [_mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", d)] == [0o700] * 3


def test_private_dir_tightens_a_directory_of_ones_own(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    d.chmod(0o755)
    private_dir(d)
    assert _mode(d) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o702])
def test_a_directory_others_can_write_is_refused_and_left_as_it_is(tmp_path, mode):
    d = tmp_path / "d"
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(UnsafePathError, match=rf"can be written by other users \(mode {mode:04o}\).*chmod go-w"):
        private_dir(d)
    assert _mode(d) == mode


def test_a_directory_of_another_user_is_refused(tmp_path, another_user):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    with pytest.raises(UnsafePathError, match="owned by another user.*directory of your own"):
        private_dir(d)


def test_a_symlink_to_ones_own_safe_directory_is_followed_an_unsafe_one_refused(tmp_path):
    safe, unsafe = tmp_path / "safe", tmp_path / "unsafe"
    safe.mkdir(mode=0o700)
    unsafe.mkdir()
    unsafe.chmod(0o777)
    (tmp_path / "to-safe").symlink_to(safe)
    (tmp_path / "to-unsafe").symlink_to(unsafe)
    assert private_dir(tmp_path / "to-safe") == tmp_path / "to-safe"
    with pytest.raises(UnsafePathError, match="written by other users"):
        private_dir(tmp_path / "to-unsafe")


def test_a_file_in_the_place_of_a_directory_is_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        private_dir(f)
    with pytest.raises(NotADirectoryError):
        check_dir(f)


# --- files ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["w", "wb", "a", "ab", "x", "xb"])
def test_open_private_creates_files_0600(tmp_path, open_umask, mode):
    f = tmp_path / "f"
    with open_private(f, mode) as fh:
        fh.write(b"data" if "b" in mode else "data")
    assert f.read_text() == "data" and _mode(f) == 0o600


def test_open_private_tightens_an_existing_file_and_appends_or_truncates(tmp_path):
    f = tmp_path / "f"
    f.write_text("one\n")
    f.chmod(0o644)
    with open_private(f, "a") as fh:
        fh.write("two\n")
    assert f.read_text() == "one\ntwo\n" and _mode(f) == 0o600
    with open_private(f, "w") as fh:
        fh.write("é")
    assert f.read_text(encoding="utf-8") == "é"
    with open_private(f, "rb+") as fh:
        assert fh.read() == "é".encode()


@pytest.mark.parametrize("mode", ["w", "a", "rb+", "r", "x"])
def test_a_symlink_is_never_followed(tmp_path, mode):
    target = tmp_path / "target"
    target.write_text("keep me")
    target.chmod(0o644)
    link = tmp_path / "log"
    link.symlink_to(target)
    with pytest.raises((UnsafePathError, FileExistsError)) as err:
        open_private(link, mode)
    if mode != "x":  # "x" refuses any existing name, a link included
        assert "symlink" in str(err.value) and "remove it or give another path" in str(err.value)
    assert target.read_text() == "keep me" and _mode(target) == 0o644  # neither truncated nor chmodded


def test_a_dangling_symlink_creates_nothing_at_its_target(tmp_path):
    link = tmp_path / "log"
    link.symlink_to(tmp_path / "planted")
    for mode in ("w", "a"):
        with pytest.raises(UnsafePathError, match="symlink"):
            open_private(link, mode)
    assert not (tmp_path / "planted").exists()


def test_what_is_not_a_regular_file_or_not_ones_own_is_refused(tmp_path, monkeypatch):
    with pytest.raises(UnsafePathError, match="not a regular file"):
        open_private(tmp_path, "r")
    f = tmp_path / "f"
    f.write_text("theirs")
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    with pytest.raises(UnsafePathError, match="owned by another user"):
        open_private(f, "a")


def test_unsupported_modes_are_refused():
    with pytest.raises(ValueError, match="unsupported mode"):
        open_private("whatever", "w+")


def test_write_private_replaces_atomically_and_never_writes_a_links_target(tmp_path, open_umask):
    f = tmp_path / "version.json"
    write_private(f, "{}")
    assert f.read_text() == "{}" and _mode(f) == 0o600
    write_private(f, b"{\"v\": 2}")
    assert f.read_bytes() == b"{\"v\": 2}"
    target = tmp_path / "target"
    target.write_text("keep me")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_private(link, "new")
    assert not link.is_symlink() and link.read_text() == "new" and target.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target", "version.json"]  # no temporaries
