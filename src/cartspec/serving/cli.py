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
    public: bool = typer.Option(False, "--public", help="listen on every interface (0.0.0.0): the script's vLLM "
                                                        "and compose's published port; default 127.0.0.1 only"),
    api_key_env: str = typer.Option("VLLM_API_KEY", "--api-key-env", metavar="NAME",
                                    help="the environment variable that holds the API key where the deployment "
                                         "runs: the files name it and refuse to start without it, and never "
                                         "hold a key"),
) -> None:
    """Write what runs SPEC in production with plain vLLM: the `vllm serve` command line with its
    --speculative-config JSON, a docker-compose service and Helm values for the vLLM production stack, with
    the model's and head's digests (export.json).

    Safe as written: vLLM listens on 127.0.0.1 unless --public, requires an API key read from the variable
    --api-key-env names, and finds the model and head in $CARTSPEC_MODELS/target and /draft (no path of this
    machine is written; the mapping is printed here).

    Plain vLLM only: a hybrid spec (cartspec's drafter, a patch of vLLM's drafting loop that `vllm serve`
    lacks) is refused (serve it with `cartspec serve --spec`, or export its head alone, method eagle3), and
    so is an adaptive spec not yet tuned (`cartspec tune` writes one with its schedule)."""
    from ..model.convert import ModelNotFound
    from ..model.registry import HeadMismatch
    from ..serving.spec import DeploymentSpec
    from .export import MODELS_ENV, ExportRefused, build_export, source_label, write_export

    if device not in ("auto", "cpu", "cuda"):
        console.print(f"[bold red]error:[/] --device must be auto, cpu or cuda, not {device!r}")
        raise typer.Exit(2)
    try:
        dep = DeploymentSpec.load(spec)
        ex = build_export(dep, device=None if device == "auto" else device, image=image, force=force,
                          public=public, api_key_env=api_key_env)
    except (ExportRefused, HeadMismatch, ModelNotFound, FileNotFoundError, ValueError) as exc:
        console.print(f"[bold red]error:[/] cannot export {spec}: {exc}", soft_wrap=True)
        raise typer.Exit(2)
    files = write_export(ex, out or Path("runs/export") / spec.stem, source=source_label(spec))
    for note in [*ex.caveats, *ex.here]:
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    console.print(f"[green]{ex.spec.label}[/] on {ex.device} ({ex.image}), on {ex.host}, key from "
                  f"${ex.api_key_env}:", soft_wrap=True)
    for f in files:
        console.print(f"  {f}", soft_wrap=True)
    # the one place this machine's paths appear: the files name only the mounts
    console.print(f"{MODELS_ENV}: a directory with these (links to them will do):", soft_wrap=True)
    for a in ex.artifacts:
        console.print(f"  {a.mount} -> {ex.sources.get(a.mount, '?')}", soft_wrap=True, markup=False)


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
