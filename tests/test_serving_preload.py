"""On a CPU cartspec preloads Intel's OpenMP runtime and tcmalloc into vLLM, as vLLM's CPU worker asks: where
each is found, in vLLM's order (tcmalloc first); a user's own LD_PRELOAD, even empty, wins; none on a GPU."""

import os

import pytest

from cartspec.serving import engine


@pytest.fixture
def libs(tmp_path, monkeypatch):
    """A tcmalloc and a libiomp5 in made-up places, found by ``cpu_preload``; no LD_PRELOAD of the user's."""
    tc_dir = tmp_path / "usr-lib"
    tc_dir.mkdir()
    (tc_dir / "libtcmalloc_minimal.so.4").write_bytes(b"")
    iomp = tmp_path / "venv-lib" / "libiomp5.so"
    iomp.parent.mkdir()
    iomp.write_bytes(b"")
    monkeypatch.setattr(engine, "_TCMALLOC_DIRS", (str(tc_dir),))
    monkeypatch.setattr(engine.sys, "prefix", str(tmp_path / "no-venv"))
    monkeypatch.setattr(engine, "_iomp", lambda: str(iomp))
    monkeypatch.setattr(engine.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(engine.sys, "platform", "linux")
    monkeypatch.setattr(engine.machine, "has_cuda", lambda: False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    return str(tc_dir / "libtcmalloc_minimal.so.4"), str(iomp)


def test_both_libraries_found_are_preloaded_tcmalloc_first(libs):
    tc, iomp = libs
    pre = engine.cpu_preload()
    assert pre.libraries == (tc, iomp) and pre.missing == ()
    assert engine.engine_env()["LD_PRELOAD"] == f"{tc}:{iomp}"
    assert pre.describe() == "libtcmalloc_minimal.so.4, libiomp5.so"


def test_a_missing_library_is_left_out_with_what_to_install(libs, monkeypatch):
    tc, iomp = libs
    os.remove(tc)
    pre = engine.cpu_preload()
    assert pre.libraries == (iomp,) and engine.engine_env()["LD_PRELOAD"] == iomp
    (note,) = pre.missing
    assert "libtcmalloc-minimal4" in note
    monkeypatch.setattr(engine, "_iomp", lambda: None)
    assert "LD_PRELOAD" not in engine.engine_env()  # vLLM's own default (torch's libgomp) then
    assert any("intel-openmp" in m for m in engine.cpu_preload().missing)


@pytest.mark.parametrize("users", ["", "/opt/my/libjemalloc.so"])
def test_the_users_ld_preload_wins_even_empty(libs, monkeypatch, users):
    monkeypatch.setenv("LD_PRELOAD", users)
    assert engine.engine_env()["LD_PRELOAD"] == users


def test_nothing_is_preloaded_on_a_gpu_or_off_x86_linux(libs, monkeypatch):
    monkeypatch.setattr(engine.platform, "machine", lambda: "aarch64")
    assert engine.cpu_preload().libraries == () and "LD_PRELOAD" not in engine.engine_env()
    monkeypatch.setattr(engine.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(engine.machine, "has_cuda", lambda: True)
    assert "LD_PRELOAD" not in engine.engine_env()


def test_the_server_records_what_vllm_ran_with_and_the_spec_can_turn_it_off(libs, tiny_llama_dir):
    from cartspec.serving.server import VllmServer
    from cartspec.serving.spec import DeploymentSpec

    spec = DeploymentSpec(name="tiny", model=str(tiny_llama_dir))
    srv = VllmServer(spec, port=8000)
    assert srv.environment()["LD_PRELOAD"] == ":".join(libs)
    assert srv.info().versions["ld_preload"] == "libtcmalloc_minimal.so.4:libiomp5.so"
    off = VllmServer(spec.model_copy(update={"env": {"LD_PRELOAD": ""}}), port=8000)
    assert off.info().versions["ld_preload"] == ""


def test_an_export_leaves_this_machines_library_paths_out_and_says_what_to_preload(libs, tiny_llama_dir):
    from cartspec.serving.export import build_export
    from cartspec.serving.spec import DeploymentSpec

    ex = build_export(DeploymentSpec(name="tiny", model=str(tiny_llama_dir)), device="cpu")
    assert "LD_PRELOAD" not in ex.env
    assert any("libiomp5.so" in c and "LD_PRELOAD" in c for c in ex.caveats)
