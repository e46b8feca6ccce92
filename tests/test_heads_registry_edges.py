"""The head registry's edges: rollback checks the target pin as promote does, names and version refs are
validated, a corrupt version.json is listed as corrupt while the rest list, and the registry is owner-only."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cartspec.cli import app
from cartspec.model.convert import ModelNotFound
from cartspec.model.heads import (NAME_MAX, CorruptVersion, CorruptVersionError, HeadPinError, HeadRegistry,
                                  HeadRegistryError, parse_ref, resolve_registered, valid_name)
from cartspec.model.registry import resolve_head
from cartspec.private_files import UnsafePathError
from tests.test_heads import fake_head


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("CARTSPEC_HOME", str(h))
    return h


def _run(*args: str):
    res = CliRunner().invoke(app, list(args))
    return res, res.output


def _two_targets(tmp_path: Path) -> HeadRegistry:
    """shop@v0001 pinned to aaaa and current; shop@v0002 pinned to bbbb, a candidate (added with force)."""
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1", digest="aaaa"))
    reg.add(fake_head(tmp_path / "h2", digest="bbbb"), force=True)
    return reg


# --- rollback checks the pin as promote does ----------------------------------------------------------------

def test_rollback_to_a_version_pinned_to_another_target_is_refused_as_promote_is(home, tmp_path):
    reg = _two_targets(tmp_path)
    n_events = len(reg.events())
    with pytest.raises(HeadPinError) as promoted:
        reg.promote("v2", reason="try")
    with pytest.raises(HeadPinError) as rolled:
        reg.rollback(reason="try", to="v2")
    assert str(rolled.value) == str(promoted.value)  # one check, one message
    assert "shop@v0002 is pinned to target bbbb" in str(rolled.value) and "aaaa" in str(rolled.value)
    assert "--force" in str(rolled.value)
    assert reg.current().version == "v0001" and len(reg.events()) == n_events  # nothing changed or recorded
    v = reg.rollback(reason="the served target changed", to="v2", force=True)
    assert v.version == "v0002" and reg.current().version == "v0002"
    assert reg.events()[-1]["event"] == "rollback" and reg.events()[-1]["forced"] is True


def test_rollback_to_a_head_without_a_target_is_refused(home, tmp_path):
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1", digest="aaaa"))
    reg.add(fake_head(tmp_path / "h2", digest=None), force=True)
    with pytest.raises(HeadPinError, match="records no target digest"):
        reg.rollback(reason="x", to="v2")
    assert reg.current().version == "v0001"


def test_rollback_cli_refuses_another_target_with_a_clear_error(home, tmp_path):
    _two_targets(tmp_path)
    res, out = _run("heads", "rollback", "shop", "--to", "v2")
    assert res.exit_code == 2, out
    assert "Traceback" not in out
    assert "shop@v0002 is pinned to target bbbb" in out and "shop@v0001" in out and "--force" in out
    assert HeadRegistry("shop").current().version == "v0001"
    res, out = _run("heads", "rollback", "shop", "--to", "v2", "--force", "--reason", "target changed")
    assert res.exit_code == 0, out
    assert HeadRegistry("shop").current().version == "v0002"


def test_rollback_to_the_same_target_needs_no_force(home, tmp_path):
    reg = HeadRegistry("shop")
    for i in (1, 2):
        reg.add(fake_head(tmp_path / f"h{i}", digest="aaaa"))
    reg.promote("v2", reason="x")
    assert reg.rollback(reason="y").version == "v0001"


# --- names and version refs ---------------------------------------------------------------------------------

BAD_NAMES = ["shop\n", "shop\r", "\nshop", "x" * 10_000, "x" * (NAME_MAX + 1), "", " shop", "shop ", "a/b", "..",
             "../shop", ".hidden", "-shop", "shop@v1", "sh\x00op", "shöp", "[red]shop"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=range(len(BAD_NAMES)))
def test_bad_names_are_refused_in_one_line(home, name):
    assert not valid_name(name)
    with pytest.raises(HeadRegistryError, match="not a head registry name") as err:
        HeadRegistry(name)
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 400, msg
    assert f"1 to {NAME_MAX} characters" in msg


@pytest.mark.parametrize("name", ["shop", "domain", "custom-1a2b3c4d", "Shop.v2_a", "0", "x" * NAME_MAX])
def test_good_names(home, tmp_path, name):
    assert valid_name(name)
    assert HeadRegistry(name).add(fake_head(tmp_path / "h")).ref == f"{name}@v0001"


def test_a_name_with_a_newline_is_not_the_registry_without_it(home, tmp_path):
    HeadRegistry("shop").add(fake_head(tmp_path / "h1"))
    assert resolve_registered("shop").ref == "shop@v0001"
    assert resolve_registered("shop\n") is None
    assert not (home / "heads" / "shop\n").exists()


@pytest.mark.parametrize("ref", ["shop@v1\n", "shop@ v1", "shop@v", "shop@v1x", "shop@" + "9" * 10_000,
                                 "shop@1234567890", "shop@v1@v2"])
def test_bad_version_refs_are_refused_in_one_line(ref):
    with pytest.raises(HeadRegistryError, match="is not a head version") as err:
        parse_ref(ref)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


def test_parse_ref_still_takes_the_short_forms():
    assert parse_ref("shop@2") == parse_ref("shop@v2") == parse_ref("shop@v0002") == ("shop", "v0002")
    assert parse_ref("shop@v123456789") == ("shop", "v123456789")


LONG = "x" * 10_000


@pytest.mark.parametrize("args, msg", [
    (("heads", "add", "shop\n", "domain"), "'shop\\n' is not a head registry name"),
    (("heads", "add", LONG, "domain"), "(10000 characters) is not a head registry name"),
    (("heads", "list", LONG), "is not a head registry name"),
    (("heads", "show", LONG + "@v1"), "is not a head registry name"),
    (("heads", "promote", LONG + "@v1"), "is not a head registry name"),
    (("heads", "rollback", LONG), "is not a head registry name"),
    (("heads", "reject", "shop\n@v1"), "is not a head registry name"),
    (("heads", "promote", "shop@" + "9" * 10_000), "(10000 characters) is not a head version"),
    (("heads", "rollback", "shop", "--to", "9" * 10_000), "is not a head version"),
    (("heads", "add", "shop", LONG), "error:"),
], ids=["add-newline", "add-long", "list-long", "show-long", "promote-long", "rollback-long", "reject-newline",
        "promote-long-version", "rollback-long-version", "add-long-head-dir"])
def test_cli_refuses_bad_names_with_one_line_and_exit_2(home, tmp_path, args, msg):
    HeadRegistry("shop").add(fake_head(tmp_path / "h1"))
    res, out = _run(*args)
    assert res.exit_code == 2, out
    assert isinstance(res.exception, SystemExit), res.exception  # an error message, not a crash
    assert "Traceback" not in out
    assert out.strip().count("\n") == 0 and len(out) < 600, out
    assert msg in out, out


# --- corrupt versions ---------------------------------------------------------------------------------------

def _corrupt_registry(tmp_path: Path) -> HeadRegistry:
    """shop: v1 current, v2 invalid JSON, v3 a field missing, v4 version.json unreadable (a directory), v5 none,
    v6 a good candidate."""
    reg = HeadRegistry("shop")
    for i in range(1, 7):
        reg.add(fake_head(tmp_path / f"h{i}"))
    vd = reg.versions_dir
    (vd / "v0002" / "version.json").write_text('{"name": "shop", "version": "v0002", ')  # cut off mid-write
    rec = json.loads((vd / "v0003" / "version.json").read_text())
    del rec["created"]
    (vd / "v0003" / "version.json").write_text(json.dumps(rec))
    (vd / "v0004" / "version.json").unlink()
    (vd / "v0004" / "version.json").mkdir()
    (vd / "v0005" / "version.json").unlink()
    return reg


def test_corrupt_versions_are_scanned_with_their_reason_and_the_rest_load(home, tmp_path):
    reg = _corrupt_registry(tmp_path)
    assert [v.version for v in reg.versions()] == ["v0001", "v0006"]
    scanned = {v.version: v for v in reg.scan()}
    assert list(scanned) == [f"v000{i}" for i in range(1, 7)]
    reasons = {k: v.reason for k, v in scanned.items() if isinstance(v, CorruptVersion)}
    assert set(reasons) == {"v0002", "v0003", "v0004", "v0005"}
    assert reasons["v0002"].startswith("invalid version.json: Invalid JSON: EOF while parsing")
    assert reasons["v0003"] == "invalid version.json: created: Field required"
    assert "unreadable" in reasons["v0004"]
    assert reasons["v0005"] == "no version.json"
    assert reg.current().version == "v0001"


def test_list_shows_a_corrupt_version_and_lists_the_rest(home, tmp_path):
    reg = _corrupt_registry(tmp_path)
    HeadRegistry("other").add(fake_head(tmp_path / "o1"))
    reg.write_gate("v6", {"decision": "eligible", "tau_current": 2.0, "tau_candidate": 2.5})
    res, out = _run("heads", "list")
    assert res.exit_code == 0, out
    rows = {tuple(line.split()[:3]) for line in out.splitlines() if line.split()[:1] in (["shop"], ["other"])}
    assert {("shop", "v0001", "current"), ("shop", "v0006", "candidate"), ("other", "v0001", "current")} <= rows
    assert {("shop", f"v000{i}", "corrupt") for i in (2, 3, 4, 5)} <= rows
    assert "shop@v0003 corrupt: invalid version.json: created: Field required" in out
    assert "shop@v0005 corrupt: no version.json" in out
    assert "2.50 vs 2.00" in out  # the good versions' gate figures still shown


def test_commands_that_need_a_corrupt_version_fail_clearly(home, tmp_path):
    _corrupt_registry(tmp_path)
    for args in (("heads", "show", "shop@v3"), ("heads", "promote", "shop@v2"), ("heads", "reject", "shop@v4"),
                 ("heads", "rollback", "shop", "--to", "v5")):
        res, out = _run(*args)
        assert res.exit_code == 2, (args, out)
        assert "Traceback" not in out and "is corrupt" in out and "restore" in out, (args, out)
    with pytest.raises(ModelNotFound, match="shop@v0002 is corrupt"):  # serve, study: as a missing head
        resolve_head("shop@v2")
    assert resolve_head("shop@v6").name == "v0006"


def test_a_corrupt_current_version_fails_serving_clearly_and_still_lists(home, tmp_path):
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    reg.add(fake_head(tmp_path / "h2"))
    (reg.versions_dir / "v0001" / "version.json").write_text("not json")
    with pytest.raises(CorruptVersionError, match="shop@v0001 is corrupt"):
        reg.current()
    with pytest.raises(ModelNotFound, match="corrupt"):
        resolve_head("shop")
    res, out = _run("heads", "show", "shop")
    assert res.exit_code == 2 and "shop@v0001 is corrupt" in out, out
    res, out = _run("heads", "promote", "shop@v2")
    assert res.exit_code == 2 and "shop@v0001 is corrupt" in out and "Traceback" not in out, out
    res, out = _run("heads", "list", "shop")
    assert res.exit_code == 0 and "corrupt" in out and "v0002" in out, out


def test_a_new_version_never_takes_a_corrupt_ones_number(home, tmp_path):
    reg = _corrupt_registry(tmp_path)
    assert reg.add(fake_head(tmp_path / "h7")).version == "v0007"


def test_a_corrupt_gate_file_is_shown_not_fatal(home, tmp_path):
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    reg.add(fake_head(tmp_path / "h2"))
    (reg.get("v2").path / "gate.json").write_text("{")
    res, out = _run("heads", "list")
    assert res.exit_code == 0 and "corrupt gate.json" in out, out
    res, out = _run("heads", "show", "shop@v2")
    assert res.exit_code == 2 and "gate.json is not valid JSON" in out, out


def test_a_hand_edited_current_file_cannot_lead_outside_versions(home, tmp_path):
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    fake_head(reg.dir / "elsewhere")
    (reg.dir / "elsewhere" / "version.json").write_text((reg.get("v1").path / "version.json").read_text())
    (reg.dir / "current").write_text("../elsewhere\n")
    assert reg.current() is None


# --- owner-only files ---------------------------------------------------------------------------------------

def _modes(root: Path) -> dict[str, int]:
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d) / n
            out[str(p.relative_to(root))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def test_registry_directories_are_0700_and_files_0600(home, tmp_path):
    src = fake_head(tmp_path / "h1")
    (src / "tokenizer").mkdir()
    (src / "tokenizer" / "vocab.json").write_text("{}")
    for p in (src, src / "tokenizer"):
        p.chmod(0o755)
    for p in list(src.iterdir()) + [src / "tokenizer" / "vocab.json"]:
        if p.is_file():
            p.chmod(0o644)
    reg = HeadRegistry("shop")
    reg.add(src)
    reg.add(fake_head(tmp_path / "h2"))
    reg.write_gate("v2", {"decision": "eligible"})
    reg.promote("v2", reason="x")
    reg.rollback(reason="y")
    reg.reject("v2", reason="z")
    modes = _modes(home / "heads")
    expected = {"shop", "shop/versions", "shop/versions/v0001", "shop/versions/v0002", "shop/current",
                "shop/events.jsonl", "shop/.lock", "shop/versions/v0001/version.json",
                "shop/versions/v0001/tokenizer/vocab.json", "shop/versions/v0002/gate.json"}
    assert expected <= set(modes)
    assert stat.S_IMODE(os.stat(home / "heads").st_mode) == 0o700
    wrong = {p: oct(m) for p, m in modes.items()
             if m != (0o700 if (home / "heads" / p).is_dir() else 0o600)}
    assert wrong == {}
    assert not [p for p in modes if p.endswith(".tmp")]  # atomic writes leave no temporary behind


def test_an_existing_open_registry_is_tightened(home, tmp_path):
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    reg.add(fake_head(tmp_path / "h2"))
    for p in (reg.dir, reg.versions_dir):
        p.chmod(0o755)
    reg.events_path.chmod(0o644)
    reg.promote("v2", reason="x")
    assert stat.S_IMODE(reg.dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(reg.events_path.stat().st_mode) == 0o600
    assert stat.S_IMODE((reg.dir / "current").stat().st_mode) == 0o600


def test_a_registry_others_can_write_is_refused(home, tmp_path):
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    reg.add(fake_head(tmp_path / "h2"))
    reg.dir.chmod(0o777)
    with pytest.raises(UnsafePathError, match="can be written by other users"):
        reg.promote("v2", reason="x")
    res, out = _run("heads", "promote", "shop@v2")
    assert res.exit_code == 2 and "can be written by other users" in out and "Traceback" not in out, out
    assert reg.current().version == "v0001"


def test_a_symlink_in_place_of_the_events_file_is_refused(home, tmp_path):
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    reg.add(fake_head(tmp_path / "h2"))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    reg.events_path.unlink()
    reg.events_path.symlink_to(victim)
    with pytest.raises(UnsafePathError, match="symlink"):
        reg.reject("v2", reason="x")
    assert victim.read_text() == "keep me\n"


def test_version_json_is_replaced_atomically(home, tmp_path, monkeypatch):
    """A crash while rewriting a version.json leaves the old one whole (never a half-written, corrupt one)."""
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    reg.add(fake_head(tmp_path / "h2"))
    real = os.replace

    def crash(src, dst):
        if Path(dst).name == "version.json":
            raise OSError("killed")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        reg.reject("v2", reason="x")
    monkeypatch.setattr(os, "replace", real)
    assert reg.get("v2").status == "candidate"
    assert all(not isinstance(v, CorruptVersion) for v in reg.scan())


def test_a_head_or_model_path_too_long_for_the_file_system_is_a_clear_not_found():
    from cartspec.model.convert import ModelNotFound
    from cartspec.model.registry import resolve_model, resolve_plain_head

    for resolve in (resolve_plain_head, resolve_model):
        with pytest.raises(ModelNotFound, match=r"\(10000 characters\) cannot be read"):
            resolve("x" * 10000)
