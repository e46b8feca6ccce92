"""``cartspec doctor``: what this machine serves with, and what cartspec changes inside its vLLM.

It prints the machine (the CPU's vector features or the GPUs), the dtype cartspec picks and why, the libraries
it preloads into vLLM on a CPU (Intel OpenMP, tcmalloc; ``engine.cpu_preload``), the vLLM,
torch and cartspec versions, whether vLLM finds cartspec's plugin (``vllm_plugin``) through its entry point,
each patch of the plugin: whether this environment needs it (or why it is skipped) and whether the
private names of vLLM it touches hold in the installed vLLM (``vllm_plugin.registry.contract``), and which
drafters this vLLM can run (``vllm_plugin.support``). Nothing is applied and no engine starts.
``diagnose(as_vllm=VERSION)`` judges the patches and drafters for another vLLM version than the installed one.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field


@dataclass
class PatchCheck:
    name: str
    what: str
    here: str  # "needed", or "skipped: <why>" in this environment
    contract: list[str] = field(default_factory=list)  # problems with the installed vLLM (empty: it holds)
    checked: bool = True  # False: written for another vLLM than the one judged, so its contract does not matter


@dataclass
class DrafterCheck:
    name: str
    ok: bool
    reason: str  # how it runs (ok), or why it cannot and what runs it


@dataclass
class Diagnosis:
    hardware: str
    cpu_features: str
    dtype: str
    dtype_reason: str
    versions: dict[str, str]
    vllm: str | None
    pinned_vllm: str
    plugin_found: bool
    plugin_enabled: bool
    patches: list[PatchCheck]
    preload: str = ""  # LD_PRELOAD cartspec gives vLLM here ("" on a GPU, or where none is found or the user's wins)
    preload_notes: list[str] = field(default_factory=list)  # what is missing and how to install it
    drafters: list[DrafterCheck] = field(default_factory=list)  # each drafter: runs on this vLLM, or why not
    as_vllm: bool = False  # ``vllm`` is a version asked for (``diagnose(as_vllm=...)``), not the installed one
    installed_vllm: str | None = None  # the installed vLLM's version

    @property
    def ok(self) -> bool:
        """vLLM is installed, loads the plugin, and every patch's targets hold."""
        return bool(self.vllm) and self.plugin_found and self.plugin_enabled and not any(p.contract
                                                                                        for p in self.patches)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def diagnose(as_vllm: str | None = None) -> Diagnosis:
    """This machine's diagnosis; ``as_vllm``: judge the patches and the drafters as if that vLLM version were
    installed (the contract is still checked against the installed vLLM, for the patches written for it)."""
    from importlib.metadata import entry_points

    from ..machine import auto_dtype, cpu_features, engine_versions, has_cuda, hardware
    from .engine import cpu_preload, engine_env
    from ..vllm_plugin import patches
    from ..vllm_plugin.registry import PINNED_VLLM, contract, other_version, vllm_version
    from ..vllm_plugin.support import drafter_support

    dtype, why = auto_dtype()
    found = any(ep.name == "cartspec" and ep.value == "cartspec.vllm_plugin:register"
                for ep in entry_points(group="vllm.general_plugins"))
    allowed = os.environ.get("VLLM_PLUGINS")
    enabled = allowed is None or "cartspec" in [x.strip() for x in allowed.split(",")]
    installed = vllm_version()
    version = as_vllm or installed
    rows = []
    problems = contract(patches()) if installed else {}
    for p in patches():
        elsewhere = other_version(p, version)  # skipped there: its contract with this vLLM does not matter
        try:
            why_not = elsewhere or (p.needed() if version else "vLLM is not installed")
        except Exception as exc:  # noqa: BLE001 - a bad setting is shown, not raised
            why_not = f"bad setting: {exc}"
        rows.append(PatchCheck(p.name, p.what, "needed" if not why_not else f"skipped: {why_not}",
                               [] if elsewhere else problems.get(p.name, []), checked=not elsewhere))
    drafters = [DrafterCheck(s.drafter, s.ok, s.reason) for s in drafter_support(version, problems)]
    versions = {k: v for k, v in engine_versions().items() if k in ("vllm", "torch", "transformers", "cartspec",
                                                                    "cartspec_commit", "python", "cpu")}
    pre = None if has_cuda() else cpu_preload()
    return Diagnosis(hardware(), ",".join(cpu_features()), dtype, why, versions, version, PINNED_VLLM, found,
                     enabled, rows, preload=engine_env().get("LD_PRELOAD", ""),
                     preload_notes=list(pre.missing) if pre else [], drafters=drafters, as_vllm=bool(as_vllm),
                     installed_vllm=installed)


def render(d: Diagnosis) -> str:
    lines = [f"machine     {d.hardware}" + (f" ({d.versions['cpu']})" if d.versions.get("cpu") else ""),
             f"dtype       {d.dtype}: {d.dtype_reason}",
             f"vLLM        {d.vllm or 'not installed'}" + ("" if not d.vllm else
                                                          " (the tested version)" if d.vllm.split("+")[0] ==
                                                          d.pinned_vllm else f" (tested: {d.pinned_vllm})")
             + (f", judged as asked (--as-vllm); installed: {d.installed_vllm or 'none'}" if d.as_vllm else ""),
             "preload     " + (d.preload or "none: vLLM preloads torch's libgomp")
             + ("" if not d.preload_notes else " (" + "; ".join(d.preload_notes) + ")")
             + (" (your LD_PRELOAD)" if os.environ.get("LD_PRELOAD") is not None else ""),
             f"torch       {d.versions.get('torch')}, transformers {d.versions.get('transformers')}, python "
             f"{d.versions.get('python')}",
             f"cartspec    {d.versions.get('cartspec')} ({d.versions.get('cartspec_commit')})",
             "plugin      " + ("vLLM loads cartspec's plugin (entry point vllm.general_plugins: cartspec)"
                               if d.plugin_found and d.plugin_enabled else
                               "NOT FOUND: reinstall cartspec (`pip install -e .`, scripts/install.sh) so vLLM "
                               "finds its entry point" if not d.plugin_found else
                               "LEFT OUT by VLLM_PLUGINS: add cartspec to it"),
             "patches (in the order applied; 'needed' in this environment, and the private vLLM names each "
             "touches):"]
    for p in d.patches:
        state = ("contract ok" if not p.contract else "CONTRACT BROKEN: " + "; ".join(p.contract)) if p.checked else ""
        lines.append(f"  {p.name:<16} {p.here:<48} {state}".rstrip())
        lines.append(f"  {'':<16} {p.what}")
    lines.append("drafters this vLLM can run ('no': `serve` and every server cartspec starts refuse it):")
    for s in d.drafters:
        lines.append(f"  {s.name:<12} {'yes' if s.ok else 'no'}: {s.reason}")
    lines.append("ok" if d.ok else "NOT OK: see above")
    return "\n".join(lines)
