"""``cartspec tune``: a study's points -> a deployment spec with γ per batch size for this machine; and
``cartspec draft predict``: what a candidate drafter's τ would buy at the loads a study measured."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ..cli_options import run_dir_option

console = Console(stderr=True)
if not console.is_terminal:  # a log file or pipe gets whole lines and tables, not 80 squeezed columns
    console = Console(stderr=True, width=170)


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)  # a command to copy stays on one line
    raise typer.Exit(2)


def tune(
    run: list[Path] = run_dir_option(repeat="repeat it to pool several runs of this machine (each point beside "
                                            "its own run's baseline)"),
    out: Optional[Path] = typer.Option(None, "--out", help="the tuned spec (.yaml/.json; default RUN/tuned.yaml, "
                                                           "the last --run's); the reasons go beside it as "
                                                           "NAME.tune.json"),
    head: Optional[str] = typer.Option(None, help="EAGLE-3 head to tune (default: the one with the most points)"),
    max_gamma: int = typer.Option(5, help="largest γ to consider"),
    max_batch: int = typer.Option(64, help="the schedule covers batch sizes 1..this"),
    min_speedup: float = typer.Option(1.0, help="speculate only where the speedup over plain decoding beats this"),
) -> None:
    """Fit this machine's step costs to a study and write the fastest γ per batch size as a deployment spec.

    Where the points are too few to fit the costs (the quick preset), the measured loads decide: at each, the
    fastest γ whose 95% interval beats plain decoding, else γ=0; the output says which way it was decided."""
    from ..results import load_results, results_path
    from .tune import base_spec, save_tuned, tune_schedule

    for r in run:
        if not results_path(r).exists():
            _fail(f"no results.jsonl in {r}: measure first, e.g. `cartspec study --preset calibrate --out {r}`")
    runs = [load_results(r) for r in run]
    try:
        res = tune_schedule(runs, head=head, max_gamma=max_gamma, max_batch=max_batch, min_speedup=min_speedup,
                            fallback=True)
    except ValueError as exc:
        _fail(str(exc))
    base = base_spec([p for r in runs for p in r], res.head)
    spec = res.deployment(base)
    spec_path, json_path = save_tuned(res, spec, out or run[-1] / "tuned.yaml")
    print_tune(res)
    if base.max_num_seqs > max_batch:
        console.print(f"[yellow]note:[/] the deployment admits {base.max_num_seqs} sequences but the schedule "
                      f"stops at {max_batch}; past it vLLM keeps the last range's γ")
    if res.speculates:
        console.print(f"[green]spec:[/] {spec_path} ({res.method} head {res.head}, schedule "
                      f"{[list(s) for s in res.schedule]})")
    else:
        console.print(f"[yellow]spec:[/] {spec_path} decodes plainly (method none): speculation did not pay at any "
                      "batch size")
    console.print(f"tuning: {json_path}")


def print_tune(res) -> None:
    """Batch range -> γ, with the speedup it is expected to give and whether a measurement said so."""
    from rich import box
    from rich.table import Table

    c = res.cost_model
    if c is None:  # too few points for the model: the measured loads and their intervals decided
        console.print(f"[yellow]decided from the measured points[/] (no cost model): at each measured load the "
                      f"fastest γ whose 95% interval beats plain decoding by more than ×{res.min_speedup:.2f}, "
                      "else γ=0")
    else:
        k = c.coefficients
        loo = f", {c.loo_median_abs_error:.1%} leave-one-out" if c.loo_median_abs_error is not None else ""
        console.print(f"decided by the cost model on {c.n_points} points (median error {c.median_abs_error:.1%} "
                      f"in-sample{loo}): step {1e3 * k.alpha:.2f} ms + {1e3 * k.beta:.3f} ms/verified token + "
                      f"{1e3 * k.delta:.2f} ms/draft forward + {1e3 * k.epsilon:.3f} ms/drafted token; "
                      f"prefill {1e3 * k.pi:.3f} ms/prompt token [dim]({c.machine})[/]")
    temps = ", ".join(f"{x:g}" for x in res.temperatures)
    t = Table(title=f"γ per batch size, head {res.head} (speedup: mean over T={temps})", box=box.SIMPLE_HEAD)
    for col in ("batch sizes", "γ", "speedup", "basis"):
        t.add_column(col, justify="right" if col != "basis" else "left")
    by_batch = {ch.batch: ch for ch in res.choices}
    for lo, hi, kk in res.schedule:
        def span(sp: list[float]) -> str:
            return f"×{sp[0]:.2f}" if max(sp) - min(sp) < 0.005 else f"×{min(sp):.2f}–{max(sp):.2f}"

        if kk:
            rng = span([by_batch[b].speedup[kk] for b in range(lo, hi + 1)])
        else:  # what speculating would have given instead
            alt = [max((v for g, v in by_batch[b].speedup.items() if g), default=1.0) for b in range(lo, hi + 1)]
            rng = f"×1.00 (best γ>0: {span(alt)})"
        reasons = sorted({by_batch[b].reason for b in range(lo, hi + 1)})
        measured_at = [b for b in range(lo, hi + 1) if by_batch[b].reason == "measured"]
        if res.cost_model is None:  # measured loads: each one's speedup with its interval (of the best γ where off)
            loads = sorted({by_batch[b].load for b in range(lo, hi + 1) if by_batch[b].load})
            parts = []
            for at in loads:
                ch = by_batch[at]
                g = kk or max((x for x in ch.speedup if x), key=ch.speedup.get, default=0)
                if g:
                    ci = ch.interval.get(g)
                    parts.append(("" if kk else f"γ={g} ") + f"×{ch.speedup[g]:.2f} "
                                 + (f"(95% {ci[0]:.2f}–{ci[1]:.2f})" if ci else "(no interval)") + f" at {at}")
            rng = "; ".join(parts) if kk else "×1.00" + (f" (best: {'; '.join(parts)})" if parts else "")
            basis = ("measured at " + ",".join(map(str, loads)) if loads else "not measured: plain decoding")
        else:
            basis = ("measured at " + ",".join(map(str, measured_at))
                     + ("; model elsewhere" if len(reasons) > 1 else "") if measured_at else "model")
        t.add_row(f"{lo}–{hi}" if hi > lo else str(lo), str(kk) if kk else "0 (off)", rng, basis)
    console.print(t)
    for n in res.notes:
        console.print(f"[dim]note: {n}[/]")


def predict(
    run: Path = typer.Option(..., help="a study's run directory (results.jsonl): the deployment's measured points "
                                       "with the engine's step counts"),
    candidate: Path = typer.Option(..., help="the candidate's acceptance JSON (`cartspec draft acceptance --out`)"),
    reference: Optional[Path] = typer.Option(None, help="the deployment's own drafter measured on the candidate's "
                                                        "requests (its acceptance JSON): a paired τ ratio "
                                                        "(default: each point's own τ)"),
    deployment: Optional[str] = typer.Option(None, help="the run's deployment the candidate would replace "
                                                        "(default: the one at the candidate's γ and method)"),
    out: Optional[Path] = typer.Option(None, help="write the prediction as JSON"),
) -> None:
    """What a candidate drafter's τ would buy at each load a study measured: the deployment's throughput
    with the τ ratio applied to the share of its engine time that τ shortens (equal step costs, a bound)."""
    from pydantic import ValidationError
    from rich.table import Table

    from ..results import load_results
    from ..results_acceptance import AcceptanceReport
    from .predict import PredictError, predict as run_predict
    from .rows import study_rows

    if not (run / "results.jsonl").is_file():
        _fail(f"{run} holds no results.jsonl: give a study's run directory (`cartspec study --out DIR`)")
    reports = {}
    for name, path in (("candidate", candidate), ("reference", reference)):
        if path is None:
            continue
        try:
            reports[name] = AcceptanceReport.load(path)
        except FileNotFoundError:
            _fail(f"--{name} {path} does not exist: give the JSON `cartspec draft acceptance --out` wrote")
        except (ValueError, ValidationError) as exc:
            _fail(f"--{name} {path} is not an acceptance report ({str(exc).splitlines()[0]})")
    try:
        res = run_predict(study_rows(load_results(run)), reports["candidate"], reports.get("reference"),
                          deployment, run=run, candidate_path=candidate, reference_path=reference)
    except PredictError as exc:
        _fail(str(exc))
    ref = (f"τ {res.reference_tau:.3f} of the reference on the same requests" if res.reference_tau is not None
           else "each point's own τ (the study's requests; --reference pairs them)")
    t = Table(title=f"candidate τ {res.candidate_tau:.3f} (γ={res.gamma}) in place of {res.deployment}, against "
                    f"{ref}; equal step costs", title_justify="left")
    for col in ("load", "request set", "tok/s", "τ", "fixed share", "τ ratio", "× predicted", "predicted tok/s",
                "speedup now → predicted"):
        t.add_column(col, justify="left" if col in ("load", "request set") else "right")
    for p in res.points:
        sp = "—" if p.speedup is None else f"×{p.speedup:.2f} → ×{p.predicted_speedup:.2f}"
        t.add_row(f"{'c' if p.mode == 'closed' else 'rate '}{p.concurrency or p.rate:g}", p.request_set,
                  f"{p.throughput:.1f}", f"{p.tau:.2f}", f"{p.fixed_time_share:.1%}", f"{p.tau_ratio:.3f}",
                  f"×{p.ratio:.3f}", f"{p.predicted_throughput:.1f}", sp)
    Console(width=None if sys.stdout.isatty() else 170).print(t)
    for s in res.skipped:
        console.print(f"[yellow]left out[/] {s}", soft_wrap=True)
    console.print(res.note, soft_wrap=True)
    if out is not None:
        res.save(out)
        console.print(f"-> {out}")


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)


def register_draft(draft_app: typer.Typer) -> None:
    """``cartspec draft predict``: read beside the drafter's commands, computed here from a study's points."""
    draft_app.command("predict")(predict)
