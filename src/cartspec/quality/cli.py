"""``cartspec quality``: the paired tests (and optional judge) on a study's stored replies."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from ..cli_options import QUALITY_METRICS, run_dir_option

console = Console(stderr=True)
if not console.is_terminal:
    console = Console(stderr=True, width=170)


def print_quality(report: Any, out: Console = console) -> None:
    from rich import box
    from rich.table import Table

    t = Table(title=f"quality vs the baseline: {report.metric}, margin ±{100 * report.margin:g} points "
                    f"(preserved: 95% CI inside the margin)", box=box.SIMPLE_HEAD)
    for col in ("deployment", "T", "requests", "pairs", "samples", "Δ", "95% CI", "verdict", "needed", "judge W/T/L",
                "judge calibration"):
        t.add_column(col, justify="left" if col in ("deployment", "verdict", "judge calibration") else "right")
    for e in report.entries:
        needed = (f"{e.needed_n} req" + (f" or {e.needed_samples} samples" if e.needed_samples else "")
                  if e.needed_n else "—")
        j = e.judge
        cal = j.calibration if j else None
        t.add_row(e.deployment, f"{e.temperature:g}", str(e.n), str(e.pairs), str(e.samples),
                  f"{100 * e.diff:+.2f}", f"[{100 * e.ci_low:+.2f}, {100 * e.ci_high:+.2f}]", e.verdict, needed,
                  f"{j.win}/{j.tie}/{j.loss} (p={j.p_value:.2g})" if j else "—",
                  (f"{j.mode}: acc {cal.accuracy:.0%}, consistent {cal.position_consistency:.0%}, ties "
                   f"{cal.tie_rate:.0%}{'' if cal.reliable else ', UNRELIABLE'}") if cal else "—")
    out.print(t)
    for mode, cal in report.calibrations.items():
        out.print(f"judge calibration ({mode}): n={cal.n} accuracy {cal.accuracy:.1%}, position consistency "
                  f"{cal.position_consistency:.1%}, tie rate {cal.tie_rate:.1%} -> "
                  f"{'reliable' if cal.reliable else 'UNRELIABLE: the verdict rests on the structured tests'}; "
                  f"by kind: " + ", ".join(f"{k} {v:.0%}" for k, v in cal.by_kind.items()))


def quality_after_study(run: Path, *, metric: str = "exact_match", judge: Optional[str] = None,
                        console: Console = console) -> None:
    """What ``cartspec study`` runs after its sweep: the paired tests (the judge only when asked for).
    A run the tests cannot use (no baseline, no replies) is said and skipped; the report is built anyway."""
    from .study import QualityError, quality_for_run

    setup = None
    try:
        if judge:
            from .judge import JudgeSetup

            setup = JudgeSetup(url=None if judge == "local" else judge)
        report = quality_for_run(run, metric=metric, judge=setup, log=lambda m: console.print(f"  {m}"))
    except QualityError as exc:
        console.print(f"[yellow]quality: not tested: {exc}[/]")
        return
    except Exception as exc:  # the sweep's results stay; `cartspec quality --run` retries
        console.print(f"[red]quality failed: {type(exc).__name__}: {exc}; rerun `cartspec quality --run {run}`[/]")
        return
    print_quality(report, console)


def quality(
    run: Path = run_dir_option(),
    metric: str = typer.Option("exact_match", help=f"the metric the verdict rests on: {QUALITY_METRICS} "
                                                   "(all are tested and reported)"),
    margin: float = typer.Option(0.02, help="equivalence margin, as a fraction (0.02: 2 points)"),
    judge: Optional[str] = typer.Option(None, help="the judge: an OpenAI-compatible endpoint URL, or 'local' (the "
                                                   "default): start vLLM with --judge-model (default base: "
                                                   "SmolLM2-135M-Instruct) for the duration"),
    no_judge: bool = typer.Option(False, "--no-judge", help="structured tests only (seconds, no model started)"),
    judge_model: Optional[str] = typer.Option(None, "--judge-model",
                                              help="with a URL: the served model name (default: its first); "
                                                   "with 'local': base | commerce | PATH"),
    judge_api_key_env: Optional[str] = typer.Option(None, "--judge-api-key-env", metavar="VAR",
                                                    help="the environment variable holding the judge's API key"),
    judge_mode: str = typer.Option("plain", "--judge-mode", help="plain | reference (the gold answer in the prompt)"),
    judge_limit: int = typer.Option(48, "--judge-limit", help="at most this many differing pairs judged per "
                                                              "deployment and temperature"),
    calibration_pairs: int = typer.Option(8, "--calibration-pairs", help="known-answer pairs per corruption kind"),
) -> None:
    """Paired quality tests of a study's stored replies against the baseline's (no re-measurement), with an
    optional pairwise LLM judge and its calibration; writes quality.json, summary.json and the report."""
    from ..report.build import build_report
    from ..serving.endpoint import EndpointError, MissingApiKey
    from ..serving.server import DeploymentError
    from .judge import JudgeFailed
    from .study import QualityError, quality_for_run

    if not 0 < margin < 1:
        console.print("[bold red]error:[/] --margin must be a fraction between 0 and 1 (0.02 = 2 points)")
        raise typer.Exit(2)
    setup = None
    if not no_judge:
        from .judge import MODES, JudgeSetup

        if judge_mode not in MODES:
            console.print(f"[bold red]error:[/] --judge-mode must be one of {', '.join(MODES)}")
            raise typer.Exit(2)
        if judge_limit < 1 or calibration_pairs < 1:
            console.print("[bold red]error:[/] --judge-limit and --calibration-pairs must be at least 1")
            raise typer.Exit(2)
        setup = JudgeSetup(url=None if judge in (None, "local") else judge, model=judge_model,
                           api_key_env=judge_api_key_env, mode=judge_mode, limit=judge_limit,
                           calibration_per_kind=calibration_pairs)
    elif judge or judge_model or judge_api_key_env or judge_mode != "plain":
        console.print("[bold red]error:[/] --judge, --judge-model, --judge-api-key-env and --judge-mode set up the "
                      "judge, and --no-judge turns it off: give one or the other")
        raise typer.Exit(2)
    try:
        report = quality_for_run(run, metric=metric, margin=margin, judge=setup,
                                 log=lambda m: console.print(f"  {m}"))
    except (QualityError, EndpointError, MissingApiKey, JudgeFailed, DeploymentError) as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2)
    build_report(run)  # quality_for_run writes quality.json only: the command builds the report, once
    print_quality(report)
    console.print(f"quality: {run / 'quality.json'}\nsummary: {run / 'summary.json'}\nreport: {run / 'report.html'}")


def register(app: typer.Typer) -> None:
    app.command("quality")(quality)
