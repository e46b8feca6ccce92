"""``cartspec doctor``: what this machine serves with, and what cartspec changes inside its vLLM.

It prints the machine (the CPU's vector features or the GPUs), the dtype cartspec picks and why, the libraries
it preloads into vLLM on a CPU (Intel OpenMP, tcmalloc; ``engine.cpu_preload``), the vLLM,
torch and cartspec versions, whether vLLM finds cartspec's plugin (``vllm_plugin``) through its entry point,
and each patch of the plugin: whether this environment needs it (or why it is skipped) and whether the
private names of vLLM it touches hold in the installed vLLM (``vllm_plugin.registry.contract``). Nothing is
applied and no engine starts.
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

    @property
    def ok(self) -> bool:
        """vLLM is installed, loads the plugin, and every patch's targets hold."""
        return bool(self.vllm) and self.plugin_found and self.plugin_enabled and not any(p.contract
                                                                                        for p in self.patches)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def diagnose() -> Diagnosis:
    from importlib.metadata import entry_points

    from ..machine import auto_dtype, cpu_features, engine_versions, has_cuda, hardware
    from .engine import cpu_preload, engine_env
    from ..vllm_plugin import patches
    from ..vllm_plugin.registry import PINNED_VLLM, contract, vllm_version

    dtype, why = auto_dtype()
    found = any(ep.name == "cartspec" and ep.value == "cartspec.vllm_plugin:register"
                for ep in entry_points(group="vllm.general_plugins"))
    allowed = os.environ.get("VLLM_PLUGINS")
    enabled = allowed is None or "cartspec" in [x.strip() for x in allowed.split(",")]
    version = vllm_version()
    rows = []
    problems = contract(patches()) if version else {}
    for p in patches():
        try:
            why_not = p.needed() if version else "vLLM is not installed"
        except Exception as exc:  # noqa: BLE001 - a bad setting is shown, not raised
            why_not = f"bad setting: {exc}"
        rows.append(PatchCheck(p.name, p.what, "needed" if not why_not else f"skipped: {why_not}",
                               problems.get(p.name, [])))
    versions = {k: v for k, v in engine_versions().items() if k in ("vllm", "torch", "transformers", "cartspec",
                                                                    "cartspec_commit", "python", "cpu")}
    pre = None if has_cuda() else cpu_preload()
    return Diagnosis(hardware(), ",".join(cpu_features()), dtype, why, versions, version, PINNED_VLLM, found,
                     enabled, rows, preload=engine_env().get("LD_PRELOAD", ""),
                     preload_notes=list(pre.missing) if pre else [])


def render(d: Diagnosis) -> str:
    lines = [f"machine     {d.hardware}" + (f" ({d.versions['cpu']})" if d.versions.get("cpu") else ""),
             f"dtype       {d.dtype}: {d.dtype_reason}",
             f"vLLM        {d.vllm or 'not installed'}" + ("" if not d.vllm else
                                                          " (the tested version)" if d.vllm.split("+")[0] ==
                                                          d.pinned_vllm else f" (tested: {d.pinned_vllm})"),
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
        state = "contract ok" if not p.contract else "CONTRACT BROKEN: " + "; ".join(p.contract)
        lines.append(f"  {p.name:<16} {p.here:<48} {state}")
        lines.append(f"  {'':<16} {p.what}")
    lines.append("ok" if d.ok else "NOT OK: see above")
    return "\n".join(lines)
