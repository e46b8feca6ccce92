"""``cartspec``: one subcommand per pipeline stage.

Heavy imports (torch, transformers, vllm) happen inside commands, so ``--help``
is instant and a missing engine is reported by the command that needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .cli_options import (dtype_option, model_option, served_name_option, server_api_key_env_option,
                          structured_option)
from .model.build import AdapterTraining
from .task.data import DataFileError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Fast fine-tuned commerce models: EAGLE-3 speculative decoding on vLLM, measured.")
console = Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


@app.callback()
def _every_command() -> None:
    # Before any command runs: a SIGTERM/SIGHUP to cartspec stops the vLLM servers it started
    # (study, serve, eval-model, draft), where the default would die and leave them running.
    from .serving.server import install_signal_handlers

    install_signal_handlers()


@app.command()
def data(out_dir: Path = typer.Option(Path("runs/data"), "--out", help="where train/dev/test.jsonl go"),
         train: int = 2400, dev: int = 200, test: int = 400, seed: int = 0) -> None:
    """Generate the commerce task splits (seeded, with gold answers)."""
    from .task.data import write_requests
    from .task.generator import generate

    for split, n in (("train", train), ("dev", dev), ("test", test)):
        path = write_requests(out_dir / f"{split}.jsonl", generate(split, n, seed))
        console.print(f"{split}: {n} requests -> {path}")


# What build-model trains with; they only matter when it trains (first build, --retrain, a new --adapter-out).
TRAINING_OPTIONS = tuple(AdapterTraining.model_fields)
RECIPE = AdapterTraining()  # the defaults the options show


@app.command("build-model")
def build_model(
    ctx: typer.Context,
    gguf: Optional[Path] = typer.Option(None, help="GGUF to start from (default: bundled SmolLM2-135M-Instruct)"),
    adapter_out: Optional[Path] = typer.Option(
        None, help="where the LoRA adapter goes; required with --retrain, e.g. runs/lora/NAME "
                   "(default: the bundled adapter, used as is)"),
    train_size: int = typer.Option(RECIPE.train_size, help="training requests (the bundled adapter's recipe: "
                                                          "4000 x 1 epoch, batch 8)"),
    epochs: float = RECIPE.epochs, lr: float = RECIPE.lr, rank: int = RECIPE.rank, batch_size: int = RECIPE.batch_size,
    seed: int = RECIPE.seed,
    neftune_alpha: float = typer.Option(RECIPE.neftune_alpha, help="NEFTune embedding-noise alpha while training "
                                                                   "(0: off)"),
    retrain: bool = typer.Option(False, help="train even if an adapter exists (needs --adapter-out)"),
) -> None:
    """Convert the base model, LoRA-fine-tune it on the task (resumable) and merge it for vLLM."""
    from .model.registry import BUNDLED_ADAPTER

    # Refuse before converting or training anything: both take minutes.
    out = adapter_out or BUNDLED_ADAPTER
    exists = (out / "adapter_model.safetensors").exists()
    if retrain and adapter_out is None and exists:
        fail(f"--retrain without --adapter-out would overwrite the bundled adapter ({BUNDLED_ADAPTER}): "
             "train into a new directory with --adapter-out runs/lora/NAME "
             f"(or replace the bundled one on purpose with --adapter-out {BUNDLED_ADAPTER})")
    # Typed by the user, even at its default value (by name: typer may bring its own copy of click's enum).
    given = [o for o in TRAINING_OPTIONS if getattr(ctx.get_parameter_source(o), "name", "DEFAULT") != "DEFAULT"]
    if given and exists and not retrain:
        flags = ", ".join("--" + o.replace("_", "-") for o in given)
        where = "--retrain" if adapter_out else "--retrain --adapter-out runs/lora/NAME"
        verb = "sets" if len(given) == 1 else "set"
        fail(f"{flags} {verb} how to train, but nothing would be trained: the adapter at {out} exists "
             f"and is used as is: add {where} to train a new one with these settings")

    from .model.build import build_model as build
    from .model.convert import ModelNotFound

    train = None
    if retrain or not exists:  # a first build (no adapter anywhere yet) trains into the bundled directory
        train = AdapterTraining(train_size=train_size, epochs=epochs, lr=lr, rank=rank, batch_size=batch_size,
                                seed=seed, neftune_alpha=neftune_alpha)
    try:
        built = build(out, gguf=gguf, train=train, log=console.print)
    except ModelNotFound as exc:
        fail(str(exc))
    console.print(f"[green]fine-tuned model:[/] {built.merged}")


@app.command("eval-model")
def eval_model(
    model: str = model_option("model to score"),
    data: str = typer.Option("test", help="train | dev | test | FILE.jsonl"),
    out: Path = typer.Option(Path("runs/eval-model.json"), help="where the scores go"),
    server: Optional[str] = typer.Option(None, help="use a running OpenAI-compatible server at this URL"),
    served_name: str = served_name_option(default="cartspec"),
    server_api_key_env: Optional[str] = server_api_key_env_option(records="the scores file"),
    structured: bool = structured_option(),
    concurrency: int = 16, max_tokens: int = 160, limit: Optional[int] = None,
    dtype: str = dtype_option(),
) -> None:
    """Serve a model with vLLM and score it on a request set (temperature 0)."""
    from .quality.structured import evaluate_model
    from .serving.endpoint import EndpointError, MissingApiKey
    from .serving.server import DeploymentError

    try:
        summary = evaluate_model(model=model, data=data, out=out, server=server, served_name=served_name,
                                 structured=structured, concurrency=concurrency, max_tokens=max_tokens,
                                 limit=limit, dtype=dtype, api_key_env=server_api_key_env)
    except (DataFileError, DeploymentError, EndpointError, MissingApiKey, FileNotFoundError) as exc:
        fail(str(exc))
    keys = ("n", "json_valid", "schema_valid", "field_accuracy", "exact_match")
    console.print(" ".join(f"{k}={summary[k]:.3f}" if isinstance(summary.get(k), float) else f"{k}={summary.get(k)}"
                           for k in keys))
    console.print(f"scores -> {out}")


# --- stage commands that live beside their stage -------------------------------
def _register_stages() -> None:
    from .agent.cli import serve
    from .analysis.cli import register as register_analysis, register_draft as register_draft_analysis
    from .draft.cli import app as draft_app
    from .model.heads_cli import register as register_heads
    from .report.cli import register as register_report
    from .serving.cli import register as register_serving

    app.command("serve")(serve)
    app.add_typer(draft_app, name="draft")
    register_draft_analysis(draft_app)  # draft predict
    register_report(app)  # study, report, quality
    register_analysis(app)  # tune
    register_serving(app)  # export
    register_heads(app)  # heads list|show|promote|rollback


_register_stages()


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
