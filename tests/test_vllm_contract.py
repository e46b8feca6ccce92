"""cartspec's vLLM plugin: the private vLLM names its patches touch (the contract), and its registry's
applied / skipped / failed paths, each reported once per process."""

from __future__ import annotations

import types

import pytest

from cartspec.vllm_plugin import patches
from cartspec.vllm_plugin import registry as reg
from cartspec.vllm_plugin.registry import Patch, PatchError, PatchStatus, Target, contract, read_report, run


def test_every_private_vllm_name_the_patches_touch_holds_in_the_installed_vllm():
    pytest.importorskip("vllm")
    assert reg.pinned(), f"the tests run with the pinned vLLM {reg.PINNED_VLLM}, not {reg.vllm_version()}"
    assert contract(patches()) == {p.name: [] for p in patches()}


def test_the_contract_fails_on_a_renamed_private_attribute_and_the_patch_then_stops_the_start(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.worker import gpu_model_runner as m

    # vLLM renames the method cartspec's runner patches wrap
    monkeypatch.setattr(m.GPUModelRunner, "propose_draft_tokens", m.GPUModelRunner.propose_draft_token_ids,
                        raising=False)
    monkeypatch.delattr(m.GPUModelRunner, "propose_draft_token_ids")
    broken = contract(patches())
    missing = "vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids is missing"
    assert broken["hybrid"] == [missing] and broken["idle_drafter"] == [missing]
    assert broken["cpu_expand"] == [] and broken["cpu_generators"] == []
    idle = next(p for p in patches() if p.name == "idle_drafter")
    monkeypatch.delenv("CARTSPEC_DRAFTER_AT_K0", raising=False)
    with pytest.raises(PatchError, match="'idle_drafter'.*propose_draft_token_ids is missing"):
        run(idle, m, {})


def test_a_changed_signature_breaks_the_contract(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.utils import cpu_triton_utils

    def other(out, values, cu):  # the parameters the fix relies on are gone
        pass

    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", other)
    (problem,) = contract(patches())["cpu_expand"]
    assert "_expand_kernel_impl takes (out, values, cu)" in problem


# --- the registry on stand-in modules --------------------------------------------------------------

def _module():
    mod = types.ModuleType("standin")
    mod.f = lambda a, b: a + b
    return mod


def _patch(apply=None, needed=lambda: None, essential=False, targets=None):
    def default_apply(mod):
        mod.f = lambda a, b: a * b

    return Patch("p", "standin", "multiplies", targets if targets is not None else (Target("standin", "f", ("a",)),),
                 apply or default_apply, needed, essential)


def test_applied_once_per_process_and_reported_on_stderr(capsys):
    mod, statuses = _module(), {}
    assert run(_patch(), mod, statuses) == PatchStatus("p", "applied", pid=statuses["p"].pid)
    assert mod.f(2, 3) == 6
    calls = []
    run(_patch(apply=lambda m: calls.append(1)), mod, statuses)  # resolved already: not again
    assert calls == []
    err = capsys.readouterr().err
    assert err.count("cartspec patch: p applied (pid ") == 1


def test_skipped_with_its_reason_leaves_the_module_alone(capsys):
    mod = _module()
    status = run(_patch(needed=lambda: "not on this platform"), mod, {})
    assert (status.status, status.reason) == ("skipped", "not on this platform") and mod.f(2, 3) == 5
    assert "cartspec patch: p skipped (pid" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["missing", "signature", "raises"])
def test_a_failed_patch_stops_the_start_with_the_pinned_vllm_and_is_reported_with_another(monkeypatch, how):
    mod = _module()
    targets = {"missing": (Target("standin", "g"),), "signature": (Target("standin", "f", ("x", "y")),)}.get(how)

    def boom(m):
        raise RuntimeError("no room")

    patch = _patch(apply=boom if how == "raises" else None, targets=targets)
    monkeypatch.setattr(reg, "pinned", lambda: True)
    with pytest.raises(PatchError, match="patch 'p' \\(multiplies\\) did not apply"):
        run(patch, mod, {})
    monkeypatch.setattr(reg, "pinned", lambda: False)  # another vLLM: reported, vLLM runs as shipped
    statuses = {}
    status = run(patch, mod, statuses)
    assert status.status == "failed" and status.reason and mod.f(2, 3) == 5
    # ... except a patch the deployment cannot run without
    with pytest.raises(PatchError):
        run(_patch(apply=boom if how == "raises" else None, targets=targets, essential=True), mod, {})


def test_a_bad_setting_fails_the_patch_and_names_the_setting(monkeypatch):
    def needed():
        raise ValueError("CARTSPEC_X must be one of ('a', 'b'), got 'c'")

    monkeypatch.setattr(reg, "pinned", lambda: True)
    with pytest.raises(PatchError, match="CARTSPEC_X must be one of"):
        run(_patch(needed=needed), _module(), {})


def test_the_report_reads_back_from_a_log():
    log = "\n".join([
        "INFO starting",
        PatchStatus("cpu_expand", "applied", pid=11).line(),
        PatchStatus("hybrid", "skipped", "a reason", 11).line(),
        "(EngineCore pid=12) " + PatchStatus("hybrid", "applied", pid=12).line(),
    ])
    report = read_report(log)
    assert report["cpu_expand"] == PatchStatus("cpu_expand", "applied", "", 11)
    assert report["hybrid"] == PatchStatus("hybrid", "applied", "", 12)  # the engine's line, the later one
    assert reg.summary(report) == "cpu_expand=applied, hybrid=applied"


def test_a_server_whose_vllm_reported_no_patch_is_refused_with_what_to_do(tmp_path):
    from cartspec.serving.server import DeploymentError, VllmServer
    from cartspec.serving.spec import DeploymentSpec

    srv = VllmServer(DeploymentSpec(), log_dir=tmp_path, model_dir=tmp_path)
    srv.log_path.write_text("INFO vLLM API server version 0.32.0\nINFO Application startup complete.\n")
    with pytest.raises(DeploymentError, match="plugin did not load.*pip install -e"):
        srv._patch_report(real_vllm=True)
    assert srv._patch_report(real_vllm=False) == {}  # a stand-in server (tests) reports nothing
    srv.log_path.write_text(PatchStatus("cpu_expand", "applied", pid=3).line() + "\n")
    assert srv._patch_report(real_vllm=True)["cpu_expand"].status == "applied"


def test_doctor_lists_every_patch_in_the_order_applied():
    pytest.importorskip("vllm")
    from typer.testing import CliRunner

    from cartspec.cli import app

    res = CliRunner().invoke(app, ["doctor", "--json"])
    assert res.exit_code == 0, res.output
    import json

    d = json.loads(res.output[res.output.index("{"):res.output.rindex("}") + 1])
    assert [p["name"] for p in d["patches"]] == [p.name for p in patches()]
    assert d["plugin_found"] and d["ok"] and d["dtype"] in ("bfloat16", "float32", "float16")
    assert all(p["contract"] == [] for p in d["patches"])


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_the_offline_generator_runs_with_the_plugins_patches_and_keeps_vllms_log(tiny_llama_dir, tmp_path):
    """cartspec's own offline generation (feature capture, refresh) is a vLLM too: the plugin loads there
    through vLLM's entry point, and the log that says so is kept beside the records."""
    from cartspec.draft.features import Sampling, vllm_generate

    said = []
    out = tmp_path / "gen.jsonl"
    records = vllm_generate(tiny_llama_dir, [[1, 2, 3, 4]], [Sampling(max_tokens=4)], out, enforce_eager=True,
                            log=said.append)
    assert len(records) == 1
    report = read_report(out.with_suffix(".log").read_text())
    assert {n: s.status for n, s in report.items()} == {p.name: "applied" for p in patches()}
    assert said[0].endswith(f"vLLM's log: {out.with_suffix('.log')}")  # said before vLLM starts
    assert any(line.startswith("vLLM generation: 1/1 answers") for line in said)  # its progress, relayed
    assert "cartspec's patches: cpu_expand=applied" in said[-1]
