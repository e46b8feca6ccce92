"""Which drafters a vLLM can run: the pinned one runs them all, another runs vLLM's own through its public
speculative config and refuses cartspec's patched ones (hybrid, schema, draft cuts) with the reason and the
version that runs them; the refusal before a server starts; the patches skipped on another version; and
`cartspec doctor` saying so. The version is faked through ``registry.vllm_version``, the one place it is read."""

from __future__ import annotations

import json
import sys
import types

import pytest

from cartspec.serving.spec import DeploymentSpec
from cartspec.vllm_plugin import registry as reg
from cartspec.vllm_plugin import support
from cartspec.vllm_plugin.registry import PINNED_VLLM, Patch, Target, run
from cartspec.vllm_plugin.support import DRAFTERS, UnsupportedDrafter, check_drafter_supported, drafter_support

OURS = {"hybrid", "schema", "draft_stop"}  # cartspec's drafters: patches of the pinned vLLM's runner


def _table(version: str | None = None, problems=None) -> dict[str, support.Support]:
    return {s.drafter: s for s in drafter_support(version, problems)}


@pytest.fixture
def vllm_034(monkeypatch):
    monkeypatch.setattr(reg, "vllm_version", lambda: "0.34.0")


def _spec(**speculative) -> DeploymentSpec:
    return DeploymentSpec(speculative=speculative)


def test_the_pinned_vllm_runs_every_drafter_and_says_how(monkeypatch):
    monkeypatch.setattr(reg, "vllm_version", lambda: PINNED_VLLM + "+cpu")
    monkeypatch.setattr(support, "has_package", lambda name: True)
    table = _table(problems={})  # every contract holds
    assert list(table) == [d.name for d in DRAFTERS]
    assert all(s.ok for s in table.values()), [s.line() for s in table.values() if not s.ok]
    assert table["hybrid"].line() == ("yes: cartspec's patch hybrid (method eagle3, "
                                      "GPUModelRunner.propose_draft_token_ids wrapped)")
    assert "patches draft_vocab and draft_stop" in table["draft_stop"].reason
    assert table["eagle3"].reason.startswith("vLLM's public speculative config (method eagle3); patch draft_vocab")
    assert "idle_drafter" in table["adaptive"].reason


def test_the_installed_vllm_is_judged_against_its_real_contract():
    pytest.importorskip("vllm")
    assert reg.pinned(), f"the tests run with the pinned vLLM {PINNED_VLLM}, not {reg.vllm_version()}"
    table = _table()  # installed version, contract checked here
    for name in ("baseline", "ngram", "eagle3", "draft_model", "hybrid", "schema", "draft_stop", "adaptive"):
        assert table[name].ok, table[name].line()


def test_another_vllm_serves_eagle3_and_vllms_own_drafters_and_refuses_cartspecs_naming_the_tested_version(vllm_034):
    table = _table()
    for name in ("baseline", "ngram", "suffix", "eagle3", "draft_model", "adaptive"):
        assert table[name].ok, table[name].line()
        assert "vLLM 0.34.0 as shipped" in table[name].reason
    assert "public speculative config (method eagle3)" in table["eagle3"].reason
    for name in OURS:
        s = table[name]
        assert not s.ok
        assert s.line().startswith("no: ")
        assert f"serve it with vLLM {PINNED_VLLM}" in s.reason and "this is vLLM 0.34.0" in s.reason
        assert "docs/vllm-versions.md" in s.reason  # the route to 0.34's speculator API
    assert "cartspec's patch hybrid of vLLM 0.32.0's V1 model runner" in table["hybrid"].reason
    assert "patch schema_batch" in table["schema"].reason and "custom_class" in table["schema"].reason


def test_a_version_passed_in_wins_over_the_installed_one(monkeypatch):
    monkeypatch.setattr(reg, "vllm_version", lambda: PINNED_VLLM)
    assert not _table("0.33.0", problems={})["hybrid"].ok
    assert _table(PINNED_VLLM, problems={})["hybrid"].ok


def test_a_broken_contract_refuses_only_the_drafters_that_need_the_patch(monkeypatch):
    monkeypatch.setattr(reg, "vllm_version", lambda: PINNED_VLLM)
    missing = "vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids is missing"
    table = _table(problems={"hybrid": [missing], "draft_stop": [], "cpu_expand": []})
    assert not table["hybrid"].ok and f"hybrid: {missing}" in table["hybrid"].reason
    assert table["eagle3"].ok and table["draft_stop"].ok


def test_a_missing_package_refuses_suffix_on_the_pinned_vllm_with_the_install_line(monkeypatch):
    monkeypatch.setattr(reg, "vllm_version", lambda: PINNED_VLLM)
    monkeypatch.setattr(support, "has_package", lambda name: name != "arctic_inference")
    table = _table(problems={})
    assert table["suffix"].line() == ("no: needs the Python package arctic_inference, not installed here "
                                      "(`pip install arctic-inference`; scripts/install.sh installs it)")
    assert _table("0.34.0")["suffix"].ok  # another vLLM's own requirements are its own to check
    assert table["ngram"].ok


def test_without_vllm_nothing_runs_and_each_says_what_to_install(monkeypatch):
    monkeypatch.setattr(reg, "vllm_version", lambda: None)
    table = _table()
    assert not any(s.ok for s in table.values())
    assert "vLLM is not installed" in table["baseline"].reason and "scripts/install.sh" in table["baseline"].reason


def test_a_deployment_asks_for_its_method_and_its_cuts_and_schedule():
    assert support.drafters_of(DeploymentSpec()) == ["baseline"]
    assert support.drafters_of(_spec(method="eagle3", model="domain", num_speculative_tokens=3,
                                     draft_stop=0.5)) == ["eagle3", "draft_stop"]
    sched = _spec(method="ngram", num_speculative_tokens=3, schedule=[(1, 4, 3), (5, 32, 0)])
    assert support.drafters_of(sched) == ["ngram", "adaptive"]
    assert support.drafters_of(sched.speculative) == ["ngram", "adaptive"]  # the block alone will do


def test_the_refusal_names_the_deployment_each_drafter_the_reason_and_the_supported_version(vllm_034):
    hybrid = _spec(method="hybrid", model="domain", num_speculative_tokens=3)
    with pytest.raises(UnsupportedDrafter) as err:
        check_drafter_supported(hybrid)
    msg = str(err.value)
    assert msg.startswith(f"vLLM 0.34.0 cannot run deployment {hybrid.label}: hybrid: the hybrid drafter")
    assert f"serve it with vLLM {PINNED_VLLM}" in msg
    with pytest.raises(UnsupportedDrafter, match="schema: the schema drafter"):
        check_drafter_supported(_spec(method="schema", num_speculative_tokens=3))
    cut = _spec(method="eagle3", model="domain", num_speculative_tokens=3, draft_stop=0.5)
    with pytest.raises(UnsupportedDrafter) as err:
        check_drafter_supported(cut)
    assert "draft_stop: draft cuts per request" in str(err.value) and "eagle3:" not in str(err.value)
    # EAGLE-3, with a schedule, and vLLM's own methods go through
    check_drafter_supported(_spec(method="eagle3", model="domain", num_speculative_tokens=3,
                                  schedule=[(1, 4, 3), (5, 32, 1)]))
    check_drafter_supported(_spec(method="ngram", num_speculative_tokens=3))
    check_drafter_supported(DeploymentSpec())


def test_the_pinned_vllm_lets_every_deployment_through(monkeypatch):
    monkeypatch.setattr(reg, "vllm_version", lambda: PINNED_VLLM)
    monkeypatch.setattr(support, "has_package", lambda name: True)
    check_drafter_supported(_spec(method="hybrid", model="domain", num_speculative_tokens=3, draft_stop=0.5))
    check_drafter_supported(_spec(method="schema", num_speculative_tokens=3))


def test_a_server_refuses_before_starting_vllm(vllm_034, monkeypatch, tmp_path):
    from cartspec.serving import server as srv_mod
    from cartspec.serving.server import VLLM_MODULE, DeploymentError, VllmServer

    def no_start(*a, **k):
        raise AssertionError("vLLM must not start")

    monkeypatch.setattr(srv_mod.subprocess, "Popen", no_start)
    monkeypatch.setattr(VllmServer, "command", lambda self: [sys.executable, "-m", VLLM_MODULE])
    srv = VllmServer(_spec(method="schema", num_speculative_tokens=3), log_dir=tmp_path / "logs", model_dir=tmp_path)
    with pytest.raises(DeploymentError, match=f"vLLM 0.34.0 cannot run deployment .*vLLM {PINNED_VLLM}"):
        srv.start()
    assert not srv.log_path.exists()


# --- the plugin on another vLLM: every patch skipped with its reason, at once -------------------------

def _standin_patch(vllm=PINNED_VLLM, essential=False):
    def apply(mod):
        mod.f = lambda a, b: a * b

    return Patch("p", "cartspec_test_never_imported", "multiplies", (Target("cartspec_test_never_imported", "f"),),
                 apply, lambda: None, essential, vllm)


def test_a_patch_for_the_pinned_vllm_is_skipped_on_another_never_failed(vllm_034, capsys):
    mod = types.ModuleType("cartspec_test_never_imported")
    mod.f = lambda a, b: a + b
    for essential in (False, True):
        status = run(_standin_patch(essential=essential), mod, {})
        assert status.status == "skipped" and mod.f(2, 3) == 5
        assert status.reason.startswith(f"written for vLLM {PINNED_VLLM}, not 0.34.0")
    assert "cartspec patch: p skipped (pid" in capsys.readouterr().err
    # a patch for any version is still tried there, and a failure of it is reported, vLLM running as shipped
    assert run(_standin_patch(vllm=None), types.ModuleType("cartspec_test_never_imported"), {}).status == "failed"


def test_install_reports_the_skip_at_once_though_the_module_is_never_imported(vllm_034, monkeypatch, capsys):
    monkeypatch.setattr(reg, "STATUSES", {})
    finders = list(sys.meta_path)
    reg.install([_standin_patch()])
    assert reg.STATUSES["p"].status == "skipped"
    assert sys.meta_path == finders  # nothing left to wait for
    assert reg.read_report(capsys.readouterr().err)["p"].status == "skipped"


def test_the_drafting_code_imports_nothing_of_an_engine():
    """The seam: ``drafting/`` (rules, gate, pointer, schema tracker) runs in the simulator and inside vLLM
    alike; everything vLLM-specific is ``vllm_plugin/``'s."""
    import ast
    from pathlib import Path

    import cartspec.drafting

    root = Path(cartspec.drafting.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in ("vllm", "sglang")]
    assert len(list(root.rglob("*.py"))) > 5 and found == []


def test_every_shipped_patch_is_written_for_the_pinned_vllm():
    from cartspec.vllm_plugin import patches

    assert {p.vllm for p in patches()} == {PINNED_VLLM}


# --- cartspec doctor ------------------------------------------------------------------------------

def _doctor(*args: str) -> tuple[int, dict]:
    from typer.testing import CliRunner

    from cartspec.cli import app

    res = CliRunner().invoke(app, ["doctor", "--json", *args])
    out = res.output
    return res.exit_code, json.loads(out[out.index("{"):out.rindex("}") + 1])


def test_doctor_lists_the_drafters_this_vllm_runs_and_judges_another_version_on_request():
    pytest.importorskip("vllm")
    code, d = _doctor()
    assert code == 0 and d["ok"]
    assert [s["name"] for s in d["drafters"]] == [x.name for x in DRAFTERS]
    assert {s["name"] for s in d["drafters"] if not s["ok"]} <= {"suffix"}  # suffix: where arctic-inference is missing
    assert d["as_vllm"] is False and d["vllm"] == d["installed_vllm"]

    code, d = _doctor("--as-vllm", "0.34.0")
    assert code == 0 and d["ok"]  # another version is no fault of this machine
    assert d["vllm"] == "0.34.0" and d["as_vllm"] and d["installed_vllm"].startswith(PINNED_VLLM)
    by = {s["name"]: s for s in d["drafters"]}
    assert {n for n, s in by.items() if not s["ok"]} == OURS
    assert f"serve it with vLLM {PINNED_VLLM}" in by["hybrid"]["reason"]
    assert by["eagle3"]["ok"] and "public speculative config" in by["eagle3"]["reason"]
    assert all(p["here"].startswith(f"skipped: written for vLLM {PINNED_VLLM}, not 0.34.0") and not p["checked"]
               for p in d["patches"])


def test_doctor_prints_a_line_per_drafter(monkeypatch):
    from cartspec.serving.doctor import Diagnosis, DrafterCheck, render

    d = Diagnosis("CPU", "avx2", "float32", "why", {}, "0.34.0", PINNED_VLLM, True, True, [],
                  drafters=[DrafterCheck("eagle3", True, "vLLM's public speculative config (method eagle3)"),
                            DrafterCheck("hybrid", False, "exists only as ...")])
    text = render(d)
    assert "  eagle3       yes: vLLM's public speculative config (method eagle3)" in text
    assert "  hybrid       no: exists only as ..." in text
