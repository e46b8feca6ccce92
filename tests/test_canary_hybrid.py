"""The canary's candidate is the deployed drafter with the candidate head: a hybrid with the candidate's pointer."""

from __future__ import annotations

import json

import pytest

from cartspec.agent.defaults import default_spec
from cartspec.agent.wiring import build_upstreams, canary_spec
from cartspec.drafting.config import HybridConfig
from test_agent_wiring import Starts


def _head(path, tag: str, pointer: bool):
    """A head directory, with its own pointer (``pointer/``, as `draft refresh` keeps it) when ``pointer``."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"tag": tag}))
    if pointer:
        (path / "pointer").mkdir()
        (path / "pointer" / "config.json").write_text(json.dumps({"tag": tag}))
        (path / "pointer" / "pointer.safetensors").write_bytes(tag.encode())
    return path


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """`shop`: v0001 current and v0002 a candidate, each with its own pointer; v0003 a candidate without one."""
    from cartspec.model.heads import HeadRegistry

    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    reg = HeadRegistry("shop")
    reg.add(_head(tmp_path / "h1", "one", pointer=True))
    reg.add(_head(tmp_path / "h2", "two", pointer=True), parent="v0001")
    reg.add(_head(tmp_path / "h3", "three", pointer=False), parent="v0001")
    return reg


def test_the_candidate_of_a_hybrid_is_a_hybrid_with_the_candidates_own_pointer(registry, tiny_llama_dir):
    target = str(tiny_llama_dir)  # no pointer was trained for it: only a version's own makes serve run the hybrid
    main = default_spec(target, "shop", 3, enforce_eager=True)
    assert main.speculative.method == "hybrid"
    start = Starts()
    ups = build_upstreams(main, start, canary_head="shop@v0002")
    started_main, cand = start.specs
    assert cand.speculative.method == "hybrid" and cand.speculative.model == "shop@v0002"
    assert ups["candidate"].head_ref == "shop@v0002"
    cur_cfg = started_main.speculative.hybrid_config(target)
    cand_cfg = cand.speculative.hybrid_config(target)
    assert cur_cfg.pointer == str(registry.get("v0001").path / "pointer")
    assert cand_cfg.pointer == str(registry.get("v0002").path / "pointer")
    assert cand_cfg.rule == cur_cfg.rule == "pointer"


def test_a_pointer_written_in_the_main_spec_gives_way_to_the_candidates(registry, tiny_llama_dir):
    target = str(tiny_llama_dir)
    current_own = str(registry.get("v0001").path / "pointer")
    main = default_spec(target, "shop", 3, enforce_eager=True, pointer=current_own)
    assert main.speculative.hybrid.pointer == current_own  # serve --pointer: written out in the spec
    cand = canary_spec(main, "shop@v0002")
    assert cand.speculative.hybrid_config(target).pointer == str(registry.get("v0002").path / "pointer")
    # a candidate without a pointer of its own never drafts with the current head's
    cand = canary_spec(main, "shop@v0003")
    assert cand.speculative.hybrid.pointer == "" and cand.speculative.hybrid.rule == "pointer"
    # another pointer written out, and no pointer of the candidate's own: kept as the main spec has it
    other = main.model_copy(update={"speculative": main.speculative.model_copy(
        update={"hybrid": HybridConfig(pointer="/pointers/shared")})})
    assert canary_spec(other, "shop@v0003").speculative.hybrid.pointer == "/pointers/shared"


def test_the_candidate_of_the_head_alone_is_the_head_alone(registry, tiny_llama_dir):
    main = default_spec(str(tiny_llama_dir), "shop", 3, enforce_eager=True, draft="eagle3")
    cand = canary_spec(main, "shop@v0002")
    assert cand.speculative.method == "eagle3" and cand.speculative.hybrid is None


def test_serve_deploys_the_hybrid_for_a_version_with_its_own_pointer_only(registry, tiny_llama_dir):
    said: list = []
    assert default_spec(str(tiny_llama_dir), "shop@v0002", 3, True, say=said.append).speculative.method == "hybrid"
    assert said == []
    sp = default_spec(str(tiny_llama_dir), "shop@v0003", 3, True, say=said.append).speculative
    assert sp.method == "eagle3" and any("no pointer was trained" in m for m in said)
