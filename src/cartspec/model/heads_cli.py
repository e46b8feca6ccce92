"""``cartspec heads``: the versions of a registered draft head (add, list, show, promote, roll back)."""

from __future__ import annotations

import json
import time
from typing import Any, NoReturn, Optional

import typer
from rich.console import Console

console = Console(stderr=True)
if not console.is_terminal:  # a log file or pipe gets whole lines and tables, not 80 squeezed columns
    console = Console(stderr=True, width=170)
out = Console()
if not out.is_terminal:
    out = Console(width=170)

heads_app = typer.Typer(no_args_is_help=True, help="Versioned draft heads under $CARTSPEC_HOME/heads/NAME/: "
                                                    "add, list, show, promote, roll back.")


def _fail(message: str | Exception) -> NoReturn:
    """Exit 2 with one line: ``message``, or an exception's (an OSError's path shortened, as typed paths can be
    10,000 characters)."""
    from rich.markup import escape

    from .heads import shown

    if isinstance(message, OSError) and message.filename is not None:
        message = f"{shown(str(message.filename))}: {message.strerror or message}"
    # escaped: a message quotes what was typed, and "[x]" in a name is no style
    console.print(f"[bold red]error:[/] {escape(str(message))}", soft_wrap=True)
    raise typer.Exit(2)


def _errors() -> tuple[type[Exception], ...]:
    """What a registry operation raises for a user to act on: exit 2 with its message, no traceback
    (OSError: a registry directory refused by ``private_dir``, a path too long for the file system...)."""
    from .convert import ModelNotFound
    from .heads import HeadRegistryError

    return ModelNotFound, HeadRegistryError, OSError


def _registry(name: str, must_exist: bool = True) -> Any:
    from .heads import HeadRegistry, HeadRegistryError

    try:
        reg = HeadRegistry(name)
    except HeadRegistryError as exc:
        _fail(exc)
    if must_exist and not reg.exists():
        _fail(f"no head registry {name!r} in {reg.root}: register a head with `cartspec heads add {name} HEAD_DIR` "
              f"(registries: {', '.join(_registry_names()) or 'none'})")
    return reg


def _versioned(ref: str, verb: str) -> tuple[str, str]:
    """NAME@vN -> (NAME, vN); a ref without a version, or a malformed one, fails with what to type."""
    from .heads import HeadRegistryError, parse_ref

    try:
        name, version = parse_ref(ref)
    except HeadRegistryError as exc:
        _fail(exc)
    if version is None:
        _fail(f"name the version to {verb}: `cartspec heads {verb} {name}@vN` (see `cartspec heads list {name}`)")
    return name, version


def _registry_names() -> list[str]:
    from .heads import default_root, valid_name

    root = default_root()
    # a directory named otherwise is no registry (HeadRegistry refuses the name): `heads list` lists the rest
    return sorted(d.name for d in root.iterdir() if valid_name(d.name) and (d / "versions").is_dir()) \
        if root.exists() else []


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts)) if ts else "-"


def gate_summary(gate: dict[str, Any] | None) -> tuple[str, str]:
    """(decision, τ figures) of a gate.json for a table cell: "eligible" / "not eligible", and the
    candidate's τ against current's with the paired difference's interval where the gate wrote them."""
    if not gate:
        return "-", "-"
    decision = gate.get("decision")
    if decision is None and "eligible" in gate:
        decision = "eligible" if gate["eligible"] else "not eligible"
    num = {k: v for k, v in gate.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if "tau_candidate" in num and "tau_current" in num:
        taus = f"{num['tau_candidate']:.2f} vs {num['tau_current']:.2f}"
        if "diff" in num and "ci_low" in num and "ci_high" in num:
            taus += f" (Δ {num['diff']:+.2f} [{num['ci_low']:+.2f}, {num['ci_high']:+.2f}])"
    else:
        taus = " ".join(f"{k}={v:.2f}" for k, v in num.items() if "tau" in k.lower())
    return str(decision if decision is not None else "?"), taus or "-"


@heads_app.command("add")
def add(
    name: str = typer.Argument(..., help="registry name (created when new)"),
    head_dir: str = typer.Argument(..., help="a head directory, a bundled head (domain, generic) or a "
                                                          "version of a registry (OTHER@vN)"),
    current: bool = typer.Option(False, "--current", help="make this version current at once (the first version "
                                                          "of a registry always is)"),
    force: bool = typer.Option(False, "--force", help="register a head pinned to another target than current's"),
    reason: Optional[str] = typer.Option(None, help="recorded in the registry's events"),
) -> None:
    """Register an existing head directory as a new version of NAME (copied into the registry)."""
    from .registry import resolve_head, resolve_plain_head

    reg = _registry(name, must_exist=False)
    try:  # another registry's version (OTHER@vN), else a bundled head or a path; never NAME's own current
        src = resolve_head(head_dir) if "@" in head_dir and "/" not in head_dir else resolve_plain_head(head_dir)
    except _errors() as exc:
        _fail(exc)
    prov: dict[str, Any] = {"command": "cartspec heads add " + " ".join([name, head_dir] + ["--current"] * current
                                                                         + ["--force"] * force)}
    if reason:
        prov["reason"] = reason
    try:
        v = reg.add(src, provenance=prov, status="current" if current else "candidate", force=force)
    except _errors() as exc:
        _fail(exc)
    console.print(f"[green]added[/] {v.ref} ({v.status}, target {v.target_digest or '?'}) <- {src}")
    console.print(f"  --head {v.ref} serves this version; --head {name} serves the current one")


@heads_app.command("list")
def list_(name: Optional[str] = typer.Argument(None, help="one registry (default: all)")) -> None:
    """The versions of every registry (or of NAME): status, parent, target digest, gate decision. A version
    whose version.json cannot be read is listed as corrupt, with the reason, below the others."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from .heads import CorruptVersion

    names = [name] if name else _registry_names()
    if name:
        _registry(name)
    if not names:
        from .heads import default_root

        console.print(f"no head registries in {default_root()}: register one with `cartspec heads add NAME HEAD_DIR`")
        return
    t = Table(title="draft head versions", box=box.SIMPLE_HEAD)
    for col in ("name", "version", "status", "created (UTC)", "parent", "target", "gate",
                "τ candidate vs current (gate)"):
        t.add_column(col)
    styles = {"current": "bold green", "candidate": "yellow", "rejected": "red", "retired": "dim"}
    corrupt: list[str] = []
    for n in names:
        reg = _registry(n)
        for v in reg.scan():
            if isinstance(v, CorruptVersion):
                t.add_row(n, v.version, "[bold red]corrupt[/]", "-", "-", "-", "-", "see below")
                corrupt.append(f"{v.ref} corrupt: {v.reason} ({v.path / 'version.json'})")
                continue
            try:
                decision, taus = gate_summary(reg.gate(v.version))
            except _errors():
                decision, taus = "corrupt gate.json", "-"
            t.add_row(n, v.version, f"[{styles[v.status]}]{v.status}[/]", _when(v.created), v.parent or "-",
                      v.target_digest or "?", decision, taus)
    out.print(t)
    for line in corrupt:  # whole lines, not squeezed into a column: the reason is what to act on
        out.print(f"[bold red]{escape(line)}[/]", soft_wrap=True)
    if corrupt:
        out.print("  restore a corrupt version's version.json from a backup, or remove its directory: "
                  "it cannot be served, promoted or rolled back to; the other versions are unaffected", soft_wrap=True)


@heads_app.command("show")
def show(ref: str = typer.Argument(..., help="NAME (its current version) or NAME@vN")) -> None:
    """One version: metadata (its own pointer's digest where it keeps one), provenance, the gate's decision and
    the registry events about it."""
    from .heads import HeadRegistryError, parse_ref
    from .registry import head_pointer, pointer_digest

    try:
        name, version = parse_ref(ref)
    except HeadRegistryError as exc:
        _fail(exc)
    reg = _registry(name)
    try:
        v = reg.get(version) if version else reg.current()
    except _errors() as exc:
        _fail(exc)
    if v is None:
        _fail(f"the head registry {name!r} has no current version: see `cartspec heads list {name}`")
    out.print(f"[bold]{v.ref}[/] {v.status}")
    own = head_pointer(v.path)  # a refreshed version's pointer, trained with its head
    meta = {"path": str(v.path), "created": _when(v.created), "parent": v.parent, "target_digest": v.target_digest,
            "target_name": v.target_name,
            "pointer": f"{own} (digest {pointer_digest(own)})" if own else "none of its own (hybrid: the bundled one)"}
    for k, x in meta.items():
        out.print(f"  {k}: {x if x is not None else '-'}")
    out.print("[bold]provenance[/]")
    for k, x in v.provenance.items():
        out.print(f"  {k}: {json.dumps(x) if isinstance(x, (dict, list)) else x}", soft_wrap=True)
    prov_md = v.path / "PROVENANCE.md"
    if prov_md.exists():
        out.print(f"  PROVENANCE.md: {prov_md}")
    try:
        gate = reg.gate(v.version)
    except _errors() as exc:
        _fail(exc)
    out.print("[bold]gate[/]" + ("" if gate else ": none written"))
    if gate:
        decision, taus = gate_summary(gate)
        out.print(f"  {decision}; τ {taus}", markup=False)
        out.print(json.dumps(gate, indent=2, default=str), soft_wrap=True, markup=False)
    events = [e for e in reg.events() if v.version in (e.get("version"), e.get("from"), e.get("to"))]
    out.print("[bold]events[/]" + ("" if events else ": none"))
    for e in events:
        figs = " ".join(f"{k}={x}" for k, x in (e.get("figures") or {}).items())
        out.print(f"  {_when(e.get('ts'))} {e.get('event')} {e.get('version')} "
                  f"(current {e.get('from') or '-'} -> {e.get('to') or '-'}): {e.get('reason') or ''}"
                  + (f" [{figs}]" if figs else ""), soft_wrap=True, markup=False)


@heads_app.command("promote")
def promote(
    ref: str = typer.Argument(..., help="NAME@vN"),
    reason: str = typer.Option("promoted by hand", help="recorded in the registry's events"),
    force: bool = typer.Option(False, "--force", help="promote a rejected version, or one pinned to another target"),
) -> None:
    """Make NAME@vN current: `--head NAME` (serve, study, draft acceptance) serves it from then on."""
    name, version = _versioned(ref, "promote")
    reg = _registry(name)
    try:
        before = reg.current()
        v = reg.promote(version, reason=reason, force=force)
    except _errors() as exc:
        _fail(exc)
    if before is not None and before.version == v.version:
        console.print(f"{v.ref} is already current")
        return
    console.print(f"[green]promoted[/] {v.ref} (was {before.ref if before else 'none'}); a running `cartspec serve` "
                  "serves it after a restart")


@heads_app.command("rollback")
def rollback(
    name: str = typer.Argument(..., help="registry name"),
    to: Optional[str] = typer.Option(None, "--to", help="the version to make current (default: the previous current)"),
    reason: str = typer.Option("rolled back by hand", help="recorded in the registry's events"),
    force: bool = typer.Option(False, "--force", help="roll back to a rejected version, or one pinned to another "
                                                      "target than current's"),
) -> None:
    """Make the previous current version of NAME current again (or --to vN); the rolled-back one is retired.
    Refuses what `heads promote` refuses: a rejected version, or one pinned to another target (serve would
    refuse it), unless --force."""
    reg = _registry(name)
    try:
        before = reg.current()
        v = reg.rollback(reason=reason, to=to, force=force)
    except _errors() as exc:
        _fail(exc)
    console.print(f"[green]rolled back[/] {before.ref if before else '?'} -> {v.ref}; a running `cartspec serve` "
                  "serves it after a restart")


@heads_app.command("reject")
def reject(
    ref: str = typer.Argument(..., help="NAME@vN (a candidate)"),
    reason: str = typer.Option("rejected by hand", help="recorded in the registry's events"),
) -> None:
    """Mark a candidate rejected: promote refuses it from then on (unless --force)."""
    name, version = _versioned(ref, "reject")
    reg = _registry(name)
    try:
        v = reg.reject(version, reason=reason)
    except _errors() as exc:
        _fail(exc)
    console.print(f"[yellow]rejected[/] {v.ref}")


def register(app: typer.Typer) -> None:
    """Add ``cartspec heads ...`` to ``app``."""
    app.add_typer(heads_app, name="heads")
