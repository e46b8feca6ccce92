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
    wheel: Optional[Path] = typer.Option(None, "--wheel", help="a spec that needs cartspec's vLLM plugin: this "
                                                               "cartspec wheel instead of one built from this "
                                                               "checkout"),
) -> None:
    """Write what runs SPEC in production with vLLM: the `vllm serve` command line with its
    --speculative-config JSON (the flags `cartspec serve` starts vLLM with), a docker-compose service and Helm
    values for the vLLM production stack, with the model's, head's and pointer's digests (export.json).

    The hybrid, the schema drafter, draft cuts and a tuned schedule's γ=0 steps need cartspec's vLLM plugin:
    for them the export also builds cartspec's wheel (wheels/, nothing uploaded) and writes Dockerfile.cpu and
    Dockerfile.cuda, vLLM's pinned images with the wheel installed, which compose builds; vLLM loads the plugin
    through its entry point, and the files name the patches its log must report applied.

    Safe as written: vLLM listens on 127.0.0.1 unless --public, requires an API key read from the variable
    --api-key-env names, and finds the model, head and pointer in $CARTSPEC_MODELS/target, /draft and /pointer
    (no path of this machine is written; the mapping is printed here). An adaptive spec not yet tuned is
    refused (`cartspec tune` writes one with its schedule)."""
    from ..model.convert import ModelNotFound
    from ..model.registry import HeadMismatch
    from ..serving.spec import DeploymentSpec
    from .export import (MODELS_ENV, ExportRefused, build_export, build_wheel, source_label, with_wheel,
                         write_export)

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
    out = out or Path("runs/export") / spec.stem
    try:
        if ex.plugin:  # cartspec inside vLLM's image: its wheel beside the files
            ex = with_wheel(ex, wheel or build_wheel(out / "wheels"), out)
    except (ExportRefused, ValueError, OSError) as exc:
        console.print(f"[bold red]error:[/] cannot export {spec}: {exc}", soft_wrap=True)
        raise typer.Exit(2)
    files = write_export(ex, out, source=source_label(spec))
    for note in [*ex.caveats, *ex.here]:
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    console.print(f"[green]{ex.spec.label}[/] on {ex.device} ({ex.image}), on {ex.host}, key from "
                  f"${ex.api_key_env}:", soft_wrap=True)
    if ex.plugin:
        console.print(f"cartspec's vLLM plugin ({', '.join(ex.plugin)}) from wheels/{ex.wheel}", soft_wrap=True,
                      markup=False)
    for f in files:
        console.print(f"  {f}", soft_wrap=True)
    # the one place this machine's paths appear: the files name only the mounts
    console.print(f"{MODELS_ENV}: a directory with these (links to them will do):", soft_wrap=True)
    for a in ex.artifacts:
        console.print(f"  {a.mount} -> {ex.sources.get(a.mount, '?')}", soft_wrap=True, markup=False)


def doctor(as_json: bool = typer.Option(False, "--json", help="print the diagnosis as JSON"),
           as_vllm: Optional[str] = typer.Option(None, "--as-vllm", metavar="VERSION",
                                                 help="judge the patches and drafters for this vLLM version instead "
                                                      "of the installed one (e.g. 0.34.0: what a user on that vLLM "
                                                      "gets), without installing it")) -> None:
    """What this machine serves with: the hardware, the dtype pick, the vLLM version, every patch of cartspec's
    vLLM plugin (needed here or skipped, and whether the vLLM names it touches hold), and which drafters this
    vLLM can run (yes, or no with the reason and the vLLM that runs it). Exits 1 when vLLM is missing, does not
    load the plugin, or a patch's contract is broken."""
    import json

    from .doctor import diagnose, render

    d = diagnose(as_vllm=as_vllm)
    print(json.dumps(d.to_dict(), indent=1) if as_json else render(d))
    if not d.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("export")(export)
    app.command("doctor")(doctor)
