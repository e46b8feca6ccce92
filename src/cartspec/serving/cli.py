"""``cartspec export``: a deployment spec -> the files that run it with plain vLLM in production."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ..cli_options import force_option

console = Console(stderr=True)


def export(
    spec: Path = typer.Option(..., "--spec", help="a DeploymentSpec file (YAML/TOML/JSON): examples/*.yaml, or the "
                                                  "tuned.yaml `cartspec tune` writes"),
    out: Optional[Path] = typer.Option(None, "--out", help="where the files go (default runs/export/SPEC-NAME)"),
    device: str = typer.Option("auto", help="auto (this machine) | cpu | cuda"),
    image: Optional[str] = typer.Option(None, help="container image REPO:TAG (default: vLLM's own for the device, "
                                                   "at the vLLM version installed here)"),
    force: bool = force_option("export a head"),
) -> None:
    """Write what runs SPEC in production with plain vLLM: the `vllm serve` command line with its
    --speculative-config JSON, a docker-compose service and Helm values for the vLLM production stack, with
    the model's and head's paths and digests (export.json).

    Plain vLLM only: a hybrid spec (cartspec's drafter, a patch of vLLM's drafting loop that `vllm serve`
    lacks) is refused (serve it with `cartspec serve --spec`, or export its head alone, method eagle3), and
    so is an adaptive spec not yet tuned (`cartspec tune` writes one with its schedule)."""
    from ..model.convert import ModelNotFound
    from ..model.registry import HeadMismatch
    from ..serving.spec import DeploymentSpec
    from .export import ExportRefused, build_export, write_export

    if device not in ("auto", "cpu", "cuda"):
        console.print(f"[bold red]error:[/] --device must be auto, cpu or cuda, not {device!r}")
        raise typer.Exit(2)
    try:
        dep = DeploymentSpec.load(spec)
        ex = build_export(dep, device=None if device == "auto" else device, image=image, force=force)
    except (ExportRefused, HeadMismatch, ModelNotFound, FileNotFoundError, ValueError) as exc:
        console.print(f"[bold red]error:[/] cannot export {spec}: {exc}", soft_wrap=True)
        raise typer.Exit(2)
    files = write_export(ex, out or Path("runs/export") / spec.stem, source=str(spec))
    for note in [*ex.caveats, *ex.here]:
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    console.print(f"[green]{ex.spec.label}[/] on {ex.device} ({ex.image}):")
    for f in files:
        console.print(f"  {f}")


def doctor(as_json: bool = typer.Option(False, "--json", help="print the diagnosis as JSON")) -> None:
    """What this machine serves with: the hardware, the dtype pick, the vLLM version, and every patch of
    cartspec's vLLM plugin (needed here or skipped, and whether the vLLM names it touches hold). Exits 1 when
    vLLM is missing, does not load the plugin, or a patch's contract is broken."""
    import json

    from .doctor import diagnose, render

    d = diagnose()
    print(json.dumps(d.to_dict(), indent=1) if as_json else render(d))
    if not d.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("export")(export)
    app.command("doctor")(doctor)
