"""Versioned draft heads: the registry's add, promote, rollback, reject and pinning, ``--head NAME[@vN]``
resolution, and ``cartspec heads``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cartspec.cli import app
from cartspec.model.convert import ModelNotFound
from cartspec.model.heads import (HeadPinError, HeadRegistry, HeadRegistryError, HeadVersion, parse_ref,
                                  resolve_registered, version_of)
from cartspec.model.registry import HEADS_DIR, HeadMismatch, check_head, resolve_head, target_digest


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("CARTSPEC_HOME", str(h))
    return h


def fake_head(path: Path, digest: str | None = "aaaa", weights: bytes = b"w") -> Path:
    path.mkdir(parents=True)
    conf: dict = {"architectures": ["LlamaForCausalLMEagle3"]}
    if digest:
        conf["cartspec"] = {"target": {"digest": digest, "name": f"target-{digest}"}}
    (path / "config.json").write_text(json.dumps(conf))
    (path / "model.safetensors").write_bytes(weights)
    (path / "PROVENANCE.md").write_text("# trained by a test\n")
    return path


def fake_model(path: Path, seed: int) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": 8, "seed": seed}))
    (path / "model.safetensors").write_bytes(bytes([seed]) * 16)
    return path


def test_add_list_current(home, tmp_path):
    reg = HeadRegistry("shop")
    assert not reg.exists() and reg.current() is None and reg.versions() == []
    v1 = reg.add(fake_head(tmp_path / "h1"), provenance={"command": "cartspec draft train ..."})
    assert (v1.version, v1.status, v1.ref) == ("v0001", "current", "shop@v0001")  # the first one is current
    assert reg.exists() and (home / "heads" / "shop" / "versions").is_dir()
    assert (home / "heads" / "shop" / "current").read_text().strip() == "v0001"
    assert {p.name for p in v1.path.iterdir()} == {"config.json", "model.safetensors", "PROVENANCE.md",
                                                   "version.json"}
    v2 = reg.add(fake_head(tmp_path / "h2", weights=b"w2"), parent="shop@v0001")
    assert (v2.version, v2.status, v2.parent) == ("v0002", "candidate", "v0001")
    assert v2.target_digest == "aaaa" and v2.target_name == "target-aaaa"
    assert v2.provenance["source"] == str((tmp_path / "h2").resolve())
    assert [(v.version, v.status) for v in reg.versions()] == [("v0001", "current"), ("v0002", "candidate")]
    assert reg.current().version == "v0001"
    assert [e["event"] for e in reg.events()] == ["add", "add"]
    assert reg.events()[0]["reason"] == "cartspec draft train ..."
    # the head's own files are copied: editing the source afterwards changes no version
    (tmp_path / "h2" / "model.safetensors").write_bytes(b"changed")
    assert (v2.path / "model.safetensors").read_bytes() == b"w2"


def test_add_as_current_retires_the_previous(home, tmp_path):
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    v2 = reg.add(fake_head(tmp_path / "h2"), status="current")
    assert v2.status == "current" and reg.current().version == "v0002"
    assert reg.get("v1").status == "retired"


def test_version_json_round_trips(home, tmp_path):
    v = HeadRegistry("shop").add(fake_head(tmp_path / "h1"), provenance={"window": {"first": 1.0, "n": 3}})
    loaded = HeadVersion.model_validate_json((v.path / "version.json").read_text())
    assert loaded == v
    assert HeadVersion.model_validate_json(loaded.model_dump_json()) == loaded
    assert loaded.provenance["window"] == {"first": 1.0, "n": 3}


def test_promote_and_rollback_twice(home, tmp_path):
    reg = HeadRegistry("shop")
    for i in (1, 2, 3):
        reg.add(fake_head(tmp_path / f"h{i}"))
    v2 = reg.promote("v2", reason="gate passed", figures={"tau": 3.2})
    assert v2.status == "current" and reg.current().version == "v0002"
    assert reg.get("v0001").status == "retired"
    reg.promote("shop@v0003", reason="canary")
    assert [v.status for v in reg.versions()] == ["retired", "retired", "current"]
    ev = reg.events()[-1]
    assert (ev["event"], ev["from"], ev["to"], ev["reason"]) == ("promote", "v0002", "v0003", "canary")
    assert reg.events()[-2]["figures"] == {"tau": 3.2}

    assert reg.rollback(reason="acceptance fell", figures={"tau": 2.1}).version == "v0002"
    assert reg.get("v3").status == "retired" and reg.current().version == "v0002"
    assert reg.rollback(reason="again").version == "v0001"  # the one current before v0002, not v0003 again
    assert [v.status for v in reg.versions()] == ["current", "retired", "retired"]
    with pytest.raises(HeadRegistryError, match="no previous current version.*--to"):
        reg.rollback(reason="nothing left")
    assert reg.rollback(reason="by hand", to="v3").version == "v0003"
    ev = reg.events()[-1]
    assert (ev["event"], ev["from"], ev["to"]) == ("rollback", "v0001", "v0003")
    assert reg.promote("v3", reason="again").version == "v0003"  # already current: nothing changes
    assert reg.events()[-1] == ev


def test_reject(home, tmp_path):
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    reg.add(fake_head(tmp_path / "h2"))
    v = reg.reject("v2", reason="canary: acceptance fell", figures={"tau_candidate": 2.0})
    assert v.status == "rejected" and reg.get("v2").status == "rejected"
    assert reg.events()[-1]["event"] == "reject" and reg.current().version == "v0001"
    with pytest.raises(HeadRegistryError, match="rejected .*canary: acceptance fell.*--force"):
        reg.promote("v2", reason="try")
    with pytest.raises(HeadRegistryError, match="is current: roll it back"):
        reg.reject("v1", reason="no")
    with pytest.raises(HeadRegistryError, match="rejected"):
        reg.rollback(reason="to a rejected one", to="v2")
    assert reg.promote("v2", reason="forced", force=True).status == "current"


def test_pinning_refuses_another_target_unless_forced(home, tmp_path):
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1", digest="aaaa"))
    with pytest.raises(HeadPinError, match="pinned to target bbbb.*pinned to target aaaa.*--force"):
        reg.add(fake_head(tmp_path / "h2", digest="bbbb"))
    assert [v.version for v in reg.versions()] == ["v0001"]
    with pytest.raises(HeadPinError, match="records no target digest"):
        reg.add(fake_head(tmp_path / "h3", digest=None))
    v2 = reg.add(tmp_path / "h2", force=True)
    assert v2.target_digest == "bbbb" and v2.status == "candidate"
    with pytest.raises(HeadPinError, match="aaaa"):
        reg.promote("v2", reason="new target")
    assert reg.current().version == "v0001"
    assert reg.promote("v2", reason="the served target changed", force=True).status == "current"
    assert reg.events()[-1]["forced"] is True
    # from now on the registry is pinned to bbbb
    with pytest.raises(HeadPinError):
        reg.add(fake_head(tmp_path / "h4", digest="aaaa"))


def test_check_head_refuses_a_version_for_another_target(home, tmp_path):
    """A version directory is a normal head directory: serving's check applies to it as is."""
    model_a, model_b = fake_model(tmp_path / "a", 1), fake_model(tmp_path / "b", 2)
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1", digest=target_digest(model_a)))
    path = resolve_head("shop")
    assert check_head(path, model_a) == "match"
    with pytest.raises(HeadMismatch, match="trained for another target"):
        check_head(path, model_b)


def test_resolve_head_and_refs(home, tmp_path):
    reg = HeadRegistry("shop")
    v1 = reg.add(fake_head(tmp_path / "h1"))
    v2 = reg.add(fake_head(tmp_path / "h2"))
    assert resolve_head("shop") == v1.path
    assert resolve_head("shop@v0002") == resolve_head("shop@2") == resolve_head("shop@v2") == v2.path
    reg.promote("v2", reason="x")
    assert resolve_head("shop") == v2.path
    assert version_of(resolve_head("shop")) == "shop@v0002"
    assert resolve_registered("shop").ref == "shop@v0002"
    with pytest.raises(ModelNotFound, match="no version v0009.*v0001, v0002"):
        resolve_head("shop@v9")
    # not a registry: the old resolution (bundled names, paths)
    assert resolve_head("domain") == HEADS_DIR / "domain"
    assert resolve_registered("domain") is None
    plain = fake_head(home / "heads" / "custom-1a2b3c4d")  # a head dir `draft train` wrote under heads/
    assert resolve_head(str(plain)) == plain and version_of(plain) is None
    assert resolve_registered("custom-1a2b3c4d") is None
    assert resolve_head(str(tmp_path / "h1")) == tmp_path / "h1" and version_of(tmp_path / "h1") is None
    with pytest.raises(ModelNotFound):
        resolve_head("nope")
    # a registry named like a bundled head comes first
    HeadRegistry("domain").add(HEADS_DIR / "domain")
    assert resolve_head("domain") == home / "heads" / "domain" / "versions" / "v0001"


def test_parse_ref():
    assert parse_ref("shop") == ("shop", None)
    assert parse_ref("shop@v0002") == parse_ref("shop@2") == ("shop", "v0002")
    with pytest.raises(HeadRegistryError, match="v0001, v0002"):
        parse_ref("shop@latest")


def test_current_is_replaced_atomically(home, tmp_path, monkeypatch):
    """A crash while writing the new ``current`` leaves the old one whole."""
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    reg.add(fake_head(tmp_path / "h2"))
    real = os.replace

    def crash(src, dst):
        if Path(dst).name == "current":
            raise OSError("killed")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        reg.promote("v2", reason="x")
    monkeypatch.setattr(os, "replace", real)
    assert (reg.dir / "current").read_text() == "v0001\n"
    assert reg.current().version == "v0001"
    assert [v.status for v in reg.versions()] == ["current", "candidate"]


def test_torn_event_line_is_skipped_and_repaired(home, tmp_path):
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    reg.add(fake_head(tmp_path / "h2"))
    with reg.events_path.open("a") as fh:
        fh.write('{"ts": 1, "event": "prom')  # killed mid-line
    assert len(reg.events()) == 2
    reg.promote("v2", reason="x")
    assert [e["event"] for e in reg.events()] == ["add", "add", "promote"]
    assert reg.rollback(reason="y").version == "v0001"


def test_gate_written_beside_the_version(home, tmp_path):
    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    reg.add(fake_head(tmp_path / "h2"))
    path = reg.write_gate("v2", {"decision": "eligible", "tau_current": 2.79, "tau_candidate": 3.21})
    assert path == reg.get("v2").path / "gate.json"
    assert reg.gate("v2")["tau_candidate"] == 3.21 and reg.gate("v1") is None
    v3 = reg.add(reg.get("v2").path)  # a version's own records are not copied into a new one
    assert not (v3.path / "gate.json").exists()
    assert HeadVersion.model_validate_json((v3.path / "version.json").read_text()).version == "v0003"


def test_bad_names(home):
    with pytest.raises(HeadRegistryError, match="not a head registry name"):
        HeadRegistry("a/b")
    with pytest.raises(HeadRegistryError):
        HeadRegistry("shop@v1")


def _run(*args: str):
    res = CliRunner().invoke(app, list(args))
    return res, " ".join(res.output.split())


def test_cli(home, tmp_path):
    res, out = _run("heads", "add", "shop", "domain")
    assert res.exit_code == 0, out
    assert "shop@v0001" in out and "current" in out
    res, out = _run("heads", "add", "shop", str(fake_head(tmp_path / "h2", digest="bbbb")))
    assert res.exit_code == 2 and "pinned to target bbbb" in out and "--force" in out
    res, out = _run("heads", "add", "shop", str(tmp_path / "h2"), "--force")
    assert res.exit_code == 0, out
    HeadRegistry("shop").write_gate("v2", {"eligible": False, "tau_current": 3.15, "tau_candidate": 2.8,
                                          "diff": -0.35, "ci_low": -0.5, "ci_high": -0.2})
    res, out = _run("heads", "list")
    assert res.exit_code == 0, out
    assert "v0001" in out and "v0002" in out and "candidate" in out and "not eligible" in out
    assert "2.80 vs 3.15 (Δ -0.35 [-0.50, -0.20])" in out and "52ff126cc750faa7" in out
    res, out = _run("heads", "promote", "shop@v2")
    assert res.exit_code == 2 and "pinned" in out
    res, out = _run("heads", "promote", "shop@v2", "--force", "--reason", "new target")
    assert res.exit_code == 0, out
    assert HeadRegistry("shop").current().version == "v0002"
    res, out = _run("heads", "show", "shop")
    assert res.exit_code == 0, out
    assert "shop@v0002 current" in out and "new target" in out and "\"eligible\": false" in out
    # v1 is pinned to the target before the forced change: going back to it needs --force as promoting does
    res, out = _run("heads", "rollback", "shop", "--reason", "drill")
    assert res.exit_code == 2 and "shop@v0001 is pinned to target 52ff126cc750faa7" in out and "--force" in out
    assert HeadRegistry("shop").current().version == "v0002"
    res, out = _run("heads", "rollback", "shop", "--reason", "drill", "--force")
    assert res.exit_code == 0, out
    assert HeadRegistry("shop").current().version == "v0001"
    res, out = _run("heads", "show", "shop@v1")
    assert res.exit_code == 0 and "PROVENANCE.md" in out and "drill" in out
    for args, msg in ((("heads", "show", "shop@v9"), "no version v0009"),
                      (("heads", "list", "nope"), "no head registry 'nope'"),
                      (("heads", "promote", "shop"), "name the version"),
                      (("heads", "rollback", "nope"), "cartspec heads add nope"),
                      (("heads", "add", "shop", str(tmp_path / "missing")), "not found"),
                      (("heads", "promote", "shop@latest"), "v0001, v0002")):
        res, out = _run(*args)
        assert res.exit_code == 2, (args, out)
        assert msg in out, (args, out)
    res, out = _run("heads", "add", "copy", "shop@v2")
    assert res.exit_code == 0, out
    assert HeadRegistry("copy").current().target_digest == "bbbb"
    res, out = _run("heads", "reject", "shop@v2", "--reason", "worse")
    assert res.exit_code == 0 and HeadRegistry("shop").get("v2").status == "rejected"


def test_study_points_record_the_head_version(home, tmp_path):
    """A point's config names the version it was planned with: a resumed run measures a promoted head anew,
    and points of heads outside a registry keep the keys they had."""
    from cartspec.bench.plan import SweepPlan, parse_deployment
    from cartspec.results import DeploymentInfo, PointConfig

    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    reg.add(fake_head(tmp_path / "h2"))
    plan = SweepPlan(deployments=[parse_deployment("eagle3:shop:3", "commerce")], concurrencies=[1],
                     n_requests=4)
    (p1,) = plan.all_points()
    assert p1.head == "shop" and p1.head_version == "shop@v0001"
    reg.promote("v2", reason="x")
    (p2,) = plan.all_points()
    assert p2.head_version == "shop@v0002" and p2.key != p1.key
    plain = p1.model_copy(update={"head": "domain", "head_version": None})
    old = json.loads(plain.model_dump_json())
    assert "head_version" not in old  # written as before the field existed
    assert PointConfig.model_validate(old).key == plain.key  # files written before the field load, same key
    assert PointConfig.model_validate(json.loads(p2.model_dump_json())) == p2
    info = DeploymentInfo.model_validate({"label": "x", "method": "eagle3", "model": "m"})
    assert info.head_version is None


def test_a_study_records_the_version_it_served(home, tmp_path):
    """results.jsonl: the point's config and its deployment name the registry version the server loaded."""
    import contextlib

    from cartspec.bench.plan import SweepPlan, parse_deployment
    from cartspec.bench.sweep import run_sweep
    from cartspec.results import DeploymentInfo, load_results
    from cartspec.testing.trivial_server import FakeConfig, TrivialServer

    reg = HeadRegistry("shop")
    reg.add(fake_head(tmp_path / "h1"))
    reg.add(fake_head(tmp_path / "h2"), status="current")

    class Served:
        def __init__(self, srv, spec):
            self.srv, self.spec = srv, spec

        url = property(lambda self: self.srv.url)

        def alive(self) -> bool:
            return True

        def describe(self) -> DeploymentInfo:
            sp = self.spec.speculative
            return DeploymentInfo(label=self.spec.label, method=sp.method, gamma=sp.num_speculative_tokens,
                                  head=str(resolve_head(sp.model)), model="fake", url=self.url)

        def died_reason(self) -> str:
            return "?"

    @contextlib.contextmanager
    def launch(spec, log_dir):
        with TrivialServer(FakeConfig(tokens=4)) as srv:
            yield Served(srv, spec)

    plan = SweepPlan(deployments=[parse_deployment("eagle3:shop:3", "commerce")], concurrencies=[1],
                     temperatures=[0.0], n_requests=2, warmup=0, max_tokens=8)
    run_sweep(plan, tmp_path / "run", launcher=launch)
    (r,) = load_results(tmp_path / "run")
    assert r.status == "ok", r.reason
    assert r.config.head == "shop" and r.config.head_version == "shop@v0002"
    assert r.deployment.head_version == "shop@v0002"
