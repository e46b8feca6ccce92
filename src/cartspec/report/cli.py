"""The study's commands, each ending in the study's report (HTML, summary.json and table): ``cartspec study``
(the sweep, its quality tests, the report and a verdict), ``cartspec quality`` (the paired tests on a study's
stored replies, then the report) and ``cartspec report`` (rebuilt from the results). They live with the
report, the stage above the sweep (``bench``) and the quality tests (``quality``) they run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console

from ..cli_options import (QUALITY_METRICS, dtype_option, enforce_eager_option, force_option, model_option,
                           run_dir_option, served_name_option, server_api_key_env_option, structured_option,
                           target_rps_option)

if TYPE_CHECKING:
    from ..analysis.models import StudyRow

console = Console(stderr=True)
if not console.is_terminal:  # a log file or pipe gets whole lines and tables, not 80 squeezed columns
    console = Console(stderr=True, width=170)


def print_table(rows: list[StudyRow]) -> None:
    """The per-point table a user reads first: throughput, latency, acceptance, speedup."""
    from rich import box
    from rich.table import Table

    t = Table(title="points (speedup = output throughput / baseline's at the same load and T)", box=box.SIMPLE_HEAD)
    for col in ("deployment", "load", "T", "req", "err", "tok/s", "speedup", "TTFT p50", "TPOT p50 ms",
                "E2EL p50", "E2EL p99", "accept", "τ", "JSON ok", "= base"):
        t.add_column(col, justify="left" if col == "deployment" else "right")
    f = lambda v, d=2: "—" if v is None else f"{v:.{d}f}"  # noqa: E731
    pct = lambda v: "—" if v is None else f"{v:.0%}"  # noqa: E731
    for r in rows:
        load = str(r.concurrency) if r.mode == "closed" else f"{r.rate:g}/s"
        if not r.ok:
            t.add_row(r.deployment, load, f"{r.temperature:g}", "", "", "[red]failed[/]", "", "", "", "", "",
                      "", "", "", "")
            continue
        t.add_row(r.deployment, load, f"{r.temperature:g}", str(r.n_requests), str(r.n_errors),
                  f(r.output_throughput, 1), f(r.speedup), f(r.ttft_p50, 3),
                  f(r.tpot_p50 and 1000 * r.tpot_p50, 1), f(r.e2el_p50), f(r.e2el_p99),
                  "—" if r.acceptance_rate is None else f"{r.acceptance_rate:.1%}", f(r.tau),
                  pct(r.json_valid), pct(r.agreement_vs_baseline))
    console.print(t)


def report(run: Path = run_dir_option(), target_rps: Optional[float] = target_rps_option()) -> None:
    """Rebuild a study's HTML report and summary.json from its results."""
    from .build import build_report

    if not (run / "results.jsonl").exists():
        console.print(f"[bold red]error:[/] no results.jsonl in {run}")
        raise typer.Exit(2)
    rep = build_report(run, target_rps=target_rps)
    print_table(rep.rows)
    console.print(f"[bold]verdict:[/] {rep.verdict}")
    console.print(f"report: {rep.html}\nsummary: {rep.summary}")


def _floats(text: Optional[str]) -> list[float] | None:
    return [float(x) for x in text.split(",") if x.strip()] if text else None


def _ints(text: Optional[str]) -> list[int] | None:
    return [int(x) for x in text.split(",") if x.strip()] if text else None


def study(
    preset: str = typer.Option("quick", help="quick (minutes on CPU) | paper (the published study's grid) | "
                                             "calibrate (what `cartspec tune` needs, minutes)"),
    out: Optional[Path] = typer.Option(None, "--out", help="run directory (default runs/study-PRESET); rerun to resume"),
    model: str = model_option(),
    server: Optional[str] = typer.Option(None, help="measure this running OpenAI-compatible endpoint instead"),
    served_name: Optional[str] = served_name_option(),
    server_api_key_env: Optional[str] = server_api_key_env_option(records="run.json"),
    deployments: Optional[str] = typer.Option(
        None, help="comma list replacing the preset's: baseline, ngram:3, eagle3:domain:3, eagle3:PATH:5, "
                   "eagle3:domain:auto (γ per batch size tuned for this machine), eagle3:domain:5:stop (each request's draft "
                   "cut where the head is unsure), hybrid:domain:3 (EAGLE-3 + prompt lookup), "
                   "hybrid-pointer:domain:3 (with a rule: lookup, text, pointer...), hybrid:domain:5:stop (the hybrid cut "
                   "the same way) (with --server: what that endpoint runs, for labels)"),
    spec_files: Optional[str] = typer.Option(
        None, "--spec", help="comma list of DeploymentSpec files (YAML/TOML/JSON, e.g. from `cartspec tune`), "
                             "measured after the preset's or --deployments' deployments"),
    concurrency: Optional[str] = typer.Option(None, help="comma list, e.g. 1,2,4,8"),
    rates: Optional[str] = typer.Option(None, help="open loop instead: Poisson arrival rates in req/s, e.g. 0.5,1,2"),
    temperatures: Optional[str] = typer.Option(None, help="comma list, e.g. 0,0.5"),
    request_sets: Optional[str] = typer.Option(None, "--request-set", help="commerce | search | support | handwritten | FILE.jsonl (comma list)"),
    requests: Optional[int] = typer.Option(None, "--requests", help="measured requests per point (default: the "
                                                                   "preset's per-stream rule below)"),
    requests_per_stream: Optional[int] = typer.Option(
        None, "--requests-per-stream", min=1, help="measured requests per point = this x concurrency (at least "
                                                   "--min-requests): more of them tighten each point's figure"),
    min_requests: Optional[int] = typer.Option(None, "--min-requests", min=1, help="fewest measured requests per point"),
    duration: Optional[float] = typer.Option(None, help="stop sending new requests in a point after this many seconds"),
    warmup: Optional[int] = typer.Option(None, help="warm-up requests per point (default min(concurrency, 8))"),
    max_tokens: Optional[int] = typer.Option(None, help="max output tokens per request"),
    structured: bool = structured_option(),
    enforce_eager: bool = enforce_eager_option(),
    dtype: str = dtype_option(of="of every deployment"),
    slo: float = typer.Option(2.0, help="E2EL SLO in seconds for goodput and capacity"),
    seed: int = typer.Option(0, help="at T > 0 each request carries a seed derived from this (paired runs); "
                                     "-1: send none, as production clients do"),
    target_rps: Optional[float] = target_rps_option(default_note="default 2x the baseline's capacity"),
    samples: int = typer.Option(1, min=1, help="replies per request at every point (sample j of request i gets the "
                                               "same seed on every deployment): more paired samples at T > 0 make "
                                               "the quality verdict conclusive sooner (`cartspec quality` says how many)"),
    quality_metric: str = typer.Option("exact_match", "--quality-metric",
                                       help=f"the metric the quality verdict rests on: {QUALITY_METRICS}"),
    judge: Optional[str] = typer.Option(None, help="after the sweep, also judge replies pairwise with this "
                                                   "OpenAI-compatible endpoint, or 'local' to start one (slow on CPU); "
                                                   "default: structured tests only"),
    force: bool = force_option("measure heads"),
    interleave: Optional[int] = typer.Option(
        None, min=1, help="servers up at once, measured in turn at every point so that the host's drift lands on "
                          "all alike (default: the preset's; paper 4; fewer when memory runs short); 1: one "
                          "deployment after another"),
    rounds: Optional[int] = typer.Option(
        None, min=1, help="measure every point in this many slices, the interleaved servers taking turns at each "
                          "slice (default: the preset's; paper 1): ratios between deployments then rest on pairs "
                          "measured seconds apart, and the report gives each a confidence interval"),
    restart_rounds: bool = typer.Option(
        False, "--restart-rounds", help="with --rounds: stop the servers after every round and start them again "
                                        "in rotated order, so that an offset of one server process lands on "
                                        "every deployment alike (costs a server start per deployment per round)"),
) -> None:
    """Run the speculative-decoding study (sweep, then report) and print a verdict."""
    from ..bench.cli import RichReporter
    from ..bench.study import StudySettings, StudySetupError, study_plan
    from ..bench.sweep import run_sweep
    from .build import build_report

    def items(text: Optional[str]) -> list[str] | None:
        return [x.strip() for x in text.split(",") if x.strip()] if text else None

    settings = StudySettings(
        preset=preset, model=model, server=server, served_name=served_name, server_api_key_env=server_api_key_env,
        deployments=items(deployments), spec_files=items(spec_files), concurrencies=_ints(concurrency),
        rates=_floats(rates), temperatures=_floats(temperatures),
        request_sets=[x.strip() for x in request_sets.split(",")] if request_sets else None, requests=requests,
        requests_per_stream=requests_per_stream, min_requests=min_requests, duration=duration, warmup=warmup,
        max_tokens=max_tokens, structured=structured, enforce_eager=enforce_eager, dtype=dtype, slo=slo, seed=seed,
        samples=samples, force=force, interleave=interleave, rounds=rounds, restart_rounds=restart_rounds)
    try:
        plan = study_plan(settings, warn=lambda m: console.print(f"[bold yellow]{m}[/]"))
    except StudySetupError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2)
    out = out or Path("runs") / f"study-{preset}"
    n_points = len(plan.all_points())
    if not server:
        from ..serving.engine import auto_dtype, hardware

        why = f" (auto: {auto_dtype()[1]})" if dtype == "auto" else " (--dtype)"
        console.print(f"machine: {hardware()}; dtype {', '.join(sorted({d.dtype for d in plan.deployments}))}{why}")
    console.print(f"[bold]cartspec study[/] preset={plan.name}: {len(plan.deployments)} deployments "
                  f"({', '.join(d.label for d in plan.deployments)}) × {n_points // max(len(plan.deployments), 1)} "
                  f"points each -> {out}")
    t0 = time.monotonic()
    try:
        run_sweep(plan, out, reporter=RichReporter(console), api_key_env=server_api_key_env)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted: finished points are in {out}/results.jsonl; rerun to resume[/]")
        raise typer.Exit(130)
    from ..quality.cli import quality_after_study

    quality_after_study(out, metric=quality_metric, judge=judge, console=console)
    report = build_report(out, target_rps=target_rps)
    minutes = (time.monotonic() - t0) / 60
    print_table(report.rows)
    console.print(f"\n[bold]verdict[/] ({minutes:.1f} min): {report.verdict}")
    console.print(f"report: {report.html}\nsummary: {report.summary}")


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
    from ..quality.cli import print_quality
    from ..quality.judge import JudgeFailed
    from ..quality.study import QualityError, quality_for_run
    from ..serving.endpoint import EndpointError, MissingApiKey
    from ..serving.server import DeploymentError
    from .build import build_report

    if not 0 < margin < 1:
        console.print("[bold red]error:[/] --margin must be a fraction between 0 and 1 (0.02 = 2 points)")
        raise typer.Exit(2)
    setup = None
    if not no_judge:
        from ..quality.judge import MODES, JudgeSetup

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
    print_quality(report, console)
    console.print(f"quality: {run / 'quality.json'}\nsummary: {run / 'summary.json'}\nreport: {run / 'report.html'}")


def register(app: typer.Typer) -> None:
    app.command("study")(study)
    app.command("report")(report)
    app.command("quality")(quality)
