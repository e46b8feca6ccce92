"""``cartspec draft refresh``: a new head version trained on the traffic the agent recorded (draft/refresh.py)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from ..cli_options import enforce_eager_option, force_option
from .refresh import FRESH, MIN_RECORDS, WARM, RefreshConfig

DEFAULTS = RefreshConfig(traffic=Path("."), head="x")  # the defaults the options show


def register(app: typer.Typer) -> None:
    """Add ``refresh`` to ``app``."""

    @app.command()
    def refresh(
        traffic: Path = typer.Option(..., help="traffic directory (traffic-*.jsonl, from `cartspec serve "
                                               "--record-traffic DIR`) or one traffic file"),
        head: str = typer.Option(..., help="head registry name ($CARTSPEC_HOME/heads/NAME): the new version is "
                                           "registered there as a candidate"),
        from_head: Optional[str] = typer.Option(None, "--from", help="seed the registry when it does not exist yet: "
                                                                     "domain | generic | a head directory (it "
                                                                     "becomes v0001, current)"),
        target: Optional[str] = typer.Option(None, help="model the head drafts for: base | commerce | HF directory | "
                                                        "LoRA adapter directory (default: the one the current "
                                                        "version was trained for)"),
        init: str = typer.Option(DEFAULTS.init, help="current: start from the current version's weights, its "
                                                     "draft vocabulary widened | fresh: train from scratch"),
        held_out: float = typer.Option(DEFAULTS.held_out, help="the most recent share of the distinct requests, "
                                                               "by time, never trained on (the gate's data)"),
        regenerate: str = typer.Option(DEFAULTS.regenerate, help="sampled: regenerate only replies sampled at "
                                                                 "temperature > 0 (greedily, vLLM) | all"),
        widen: Optional[int] = typer.Option(None, help="add this many of the traffic's most frequent reply tokens "
                                                       "missing from the draft vocabulary (0: none; default: every "
                                                       "one seen at least --min-count times)"),
        min_count: int = typer.Option(DEFAULTS.min_count, help="default widening: reply tokens seen this often"),
        draft_vocab: int = typer.Option(DEFAULTS.draft_vocab, help="draft vocabulary size with --init fresh"),
        epochs: Optional[float] = typer.Option(None, help=f"default {WARM['epochs']:g} with --init current, "
                                                          f"{FRESH['epochs']:g} with --init fresh"),
        steps: Optional[int] = typer.Option(None, help="optimiser steps (overrides --epochs)"),
        lr: Optional[float] = typer.Option(None, help=f"default {WARM['lr']:g} with --init current, "
                                                      f"{FRESH['lr']:g} with --init fresh"),
        ttt_steps: int = typer.Option(DEFAULTS.ttt_steps, "--ttt-steps", help="k: unrolled draft steps"),
        batch_tokens: int = typer.Option(DEFAULTS.batch_tokens, help="padded tokens per batch"),
        max_tokens: int = typer.Option(DEFAULTS.max_tokens, help="response length cap when regenerating"),
        max_minutes: Optional[float] = typer.Option(None, help="stop training (checkpointed, registered) after "
                                                               "this long"),
        save_every: int = typer.Option(DEFAULTS.save_every),
        seed: int = typer.Option(DEFAULTS.seed),
        min_records: int = typer.Option(MIN_RECORDS, help="distinct requests needed to refresh"),
        enforce_eager: bool = enforce_eager_option(when="when regenerating"),
        device: str = typer.Option(DEFAULTS.device, help="feature capture and training: auto | cpu | cuda"),
        fsdp: bool = typer.Option(False, "--fsdp", help="under torchrun: shard the head (FSDP2) instead of DDP"),
        force: bool = force_option("refresh a head or use traffic pinned to another target"),
    ) -> None:
        """Train a new version of a registered head on recorded traffic and register it as a candidate.

        Replies written at temperature 0 are the target's own and are trained on as they are; sampled ones are
        regenerated greedily with vLLM. The most recent --held-out share is set aside for the gate
        (`cartspec draft gate`). Under ``torchrun --nproc_per_node N`` training runs data-parallel as
        `cartspec draft train` does."""
        from .cli import _fail, _progress, console
        from .pipeline import DraftPipelineError
        from .refresh import refresh_head

        if init not in ("current", "fresh"):
            _fail("--init must be current or fresh")
        if regenerate not in ("sampled", "all"):
            _fail("--regenerate must be sampled or all")
        try:
            cfg = RefreshConfig(traffic=traffic, head=head, from_head=from_head, target=target, init=init,
                                held_out=held_out, regenerate=regenerate, widen=widen, min_count=min_count,
                                draft_vocab=draft_vocab, epochs=epochs, steps=steps, lr=lr, ttt_steps=ttt_steps,
                                batch_tokens=batch_tokens, max_tokens=max_tokens, max_minutes=max_minutes,
                                save_every=save_every, seed=seed, min_records=min_records,
                                enforce_eager=enforce_eager, device=device, fsdp=fsdp, force=force)
        except ValueError as exc:
            _fail(f"invalid setting: {exc}")
        command = ("cartspec draft " + " ".join(shlex.quote(a) for a in sys.argv[sys.argv.index("refresh"):])
                   if "refresh" in sys.argv else None)
        try:
            res = refresh_head(cfg, command=command, log=console.print, progress=_progress)
        except DraftPipelineError as exc:
            _fail(str(exc))
        if res is None:  # a rank other than 0 under torchrun
            return
        v = res.provenance.get("vocab", {})
        console.print(f"[green]candidate[/] {res.ref} -> {res.path} (parent {res.parent}, {res.steps} steps, "
                      f"{res.training_seconds / 60:.1f} min training; acc/step {res.acc_per_step_last20}; "
                      f"+{v.get('added', 0)} draft tokens)")
        name, _, version = res.ref.partition("@")
        console.print(f"next: `cartspec draft gate --head {name} --candidate {version} --traffic {traffic}` on the "
                      f"held-out traffic, then `cartspec heads promote {res.ref}`")
