"""``cartspec draft refresh``: a new head version trained on the traffic the agent recorded (draft/refresh.py)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from ..cli_options import enforce_eager_option, force_option
from .budget import BUDGET_CAP, BUDGET_FLOOR
from .refresh import FRESH, MIN_RECORDS, POINTER_FRESH, POINTER_WARM, WARM, RefreshConfig

DEFAULTS = RefreshConfig(traffic=Path("."), head="x")  # the defaults the options show


def coverage_line(v: dict) -> str:
    """One line from a refresh's ``vocab`` provenance: the share of held-out reply tokens inside the draft
    vocabulary before and after widening."""
    n = v.get("held_out_reply_tokens", 0)
    if not n:
        return f"draft vocabulary: +{v.get('added', 0)} tokens; no held-out replies to measure coverage on"
    share = lambda outside: f"{100 * (n - outside) / n:.1f}%"  # noqa: E731
    return (f"held-out reply tokens inside the draft vocabulary: {share(v['held_out_outside_parent'])} -> "
            f"{share(v['held_out_outside_new'])} of {n} (+{v.get('added', 0)} draft tokens)")


def training_line(t: dict) -> str:
    """One line from a refresh's ``training`` provenance: the held-out τ curve's start and best, and why
    training ended."""
    curve = t.get("tau_curve") or []
    head = f"{t.get('steps', 0)} of {t.get('budget', '?')} steps ({t.get('budget_rule', '')})"
    if not curve:
        return f"training: {head}; {t.get('stop_reason') or 'ran the budget'}"
    (s0, tau0), gamma = curve[0], (t.get("eval") or {}).get("gamma", "?")
    return (f"held-out τ (γ={gamma}): {tau0:.3f} at step {s0} -> best {t['best_tau']:.3f} at step {t['best_step']} "
            f"(kept); {head}; " + (f"stopped early: {t['stop_reason']}" if t.get("stopped_early")
                                    else t.get("stop_reason") or "ran the budget"))


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
        widen: Optional[int] = typer.Option(None, help="add this many of the training replies' most frequent "
                                                       "tokens missing from the draft vocabulary (0: none; default: "
                                                       "every one seen at least --min-count times)"),
        min_count: int = typer.Option(DEFAULTS.min_count, help="default widening: reply tokens seen this often "
                                                               "(1: a value copied once is added too)"),
        draft_vocab: int = typer.Option(DEFAULTS.draft_vocab, help="draft vocabulary size with --init fresh"),
        steps: Optional[int] = typer.Option(None, help=f"the budget in optimiser steps (default: a quarter per "
                                                       f"training record, {BUDGET_FLOOR} to {BUDGET_CAP}; twice "
                                                       f"that with --init fresh)"),
        epochs: Optional[float] = typer.Option(None, help="instead of --steps: a budget of this many passes"),
        eval_every: Optional[int] = typer.Option(None, help="held-out τ every N steps (default: about 10 times "
                                                            "per budget; 0: never, keep the last head)"),
        patience: int = typer.Option(DEFAULTS.patience, help="stop after this many held-out evaluations without "
                                                             "a gain (0: run the whole budget, keep the best)"),
        min_delta: float = typer.Option(DEFAULTS.min_delta, help="a gain: held-out τ up by more than this"),
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
        pointer: bool = typer.Option(DEFAULTS.pointer, "--pointer/--no-pointer",
                                     help="train the hybrid's pointer too, from the parent's (else the bundled "
                                          "one, where trained for the target), kept in the version's pointer/; "
                                          "--no-pointer: the version has none of its own (deployments draft "
                                          "with the bundled one)"),
        pointer_epochs: Optional[int] = typer.Option(None, help=f"pointer epochs (default {POINTER_WARM['epochs']} "
                                                                f"from a trained pointer, {POINTER_FRESH['epochs']} "
                                                                "from random weights; 0: keep the parent's)"),
    ) -> None:
        """Train a new version of a registered head on recorded traffic and register it as a candidate.

        Replies written at temperature 0 are the target's own and are trained on as they are; sampled ones are
        regenerated greedily with vLLM. The most recent --held-out share is set aside for the gate
        (`cartspec draft gate`). Under ``torchrun --nproc_per_node N`` training runs data-parallel as
        `cartspec draft train` does."""
        from .terminal import console, fail as _fail, progress as _progress
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
                                enforce_eager=enforce_eager, device=device, fsdp=fsdp, force=force,
                                pointer=pointer, pointer_epochs=pointer_epochs, eval_every=eval_every,
                                patience=patience, min_delta=min_delta)
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
        console.print(coverage_line(v), markup=False, soft_wrap=True)
        console.print(training_line(res.provenance.get("training", {})), markup=False, soft_wrap=True)
        ptr = res.provenance.get("pointer")
        if ptr:
            acc = ", ".join(f"{k} {x}" for k, x in (ptr.get("accuracy") or {}).items()) or "no held-out value starts"
            console.print(f"pointer: {ptr['init']} start, {ptr['epochs']} epochs on {ptr['examples']} value starts "
                          f"(held-out: {acc}), digest {ptr['digest'][:16]}", markup=False)
        name, _, version = res.ref.partition("@")
        console.print(f"next: `cartspec draft gate --head {name} --candidate {version} --traffic {traffic}` on the "
                      f"held-out traffic, then `cartspec heads promote {res.ref}`")
