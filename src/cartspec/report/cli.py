"""``cartspec report``: a study's HTML report, summary.json and table, rebuilt from its results."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console

from ..cli_options import run_dir_option, target_rps_option

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


def register(app: typer.Typer) -> None:
    app.command("report")(report)
