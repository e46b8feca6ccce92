"""``cartspec study``: the sweep, then its report and verdict, from the terminal."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from ..cli_options import (QUALITY_METRICS, dtype_option, enforce_eager_option, force_option, model_option,
                           served_name_option, server_api_key_env_option, structured_option, target_rps_option)

console = Console(stderr=True)
if not console.is_terminal:  # a log file or pipe gets whole lines and tables, not 80 squeezed columns
    console = Console(stderr=True, width=170)


class RichReporter:
    """Two bars: points of the sweep, requests of the point being measured."""

    def __init__(self) -> None:
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=console, transient=False)
        self.points = self.requests = None
        self.errors = 0

    def start(self, total: int, done: int) -> None:
        self.progress.start()
        self.points = self.progress.add_task("points", total=total, completed=done)
        if done:
            self.progress.console.print(f"resuming: {done} of {total} points already measured, skipped")

    def deployment(self, label: str, state: str) -> None:
        colour = {"failed": "red", "running": "green", "done": "dim"}.get(state, "yellow")
        self.progress.console.print(f"[{colour}]{label}: {state}[/]")

    def point_started(self, cfg, part: int = 0) -> None:
        if self.requests is not None:
            self.progress.remove_task(self.requests)
        self.errors = 0
        bounds = cfg.slice_bounds()
        what = f" slice {part + 1}/{len(bounds)}" if len(bounds) > 1 else ""
        self.requests = self.progress.add_task(f"  {cfg.deployment} {cfg.load} T={cfg.temperature:g}{what}",
                                               total=bounds[part][1])

    def request_done(self, ok: bool) -> None:
        self.errors += not ok
        if self.requests is not None:
            self.progress.advance(self.requests)

    def point_finished(self, res) -> None:
        self.progress.advance(self.points)
        c = res.config
        if res.status == "failed":
            self.progress.console.print(f"  [red]✗ {c.deployment} {c.load} T={c.temperature:g}: {res.reason[:160]}[/]")
            return
        acc = f" accept {res.acceptance_rate:.1%} τ {res.tau:.2f}" if res.acceptance_rate is not None else ""
        self.progress.console.print(
            f"  ✓ {c.deployment} {c.load} T={c.temperature:g}: {res.output_throughput:.1f} tok/s, "
            f"E2EL p50 {res.e2el_p50 or 0:.2f}s p99 {res.e2el_p99 or 0:.2f}s, "
            f"TTFT p50 {res.ttft_p50 or 0:.3f}s, TPOT p50 {1000 * (res.tpot_p50 or 0):.1f}ms, "
            f"errors {res.n_errors}/{res.n_requests}{acc}")

    def stop(self) -> None:
        if self.requests is not None:
            self.progress.remove_task(self.requests)
            self.requests = None
        self.progress.stop()


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
    from ..report.build import build_report
    from ..report.cli import print_table
    from .study import StudySettings, StudySetupError, study_plan
    from .sweep import run_sweep

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
        run_sweep(plan, out, reporter=RichReporter(), api_key_env=server_api_key_env)
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


def register(app: typer.Typer) -> None:
    app.command("study")(study)
