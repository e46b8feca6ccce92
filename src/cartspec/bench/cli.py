"""The sweep on the terminal (``RichReporter``: a bar of points, a bar of the point's requests), which
``cartspec study`` (``report/cli.py``: the sweep, its quality tests, then its report) passes to ``run_sweep``."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

console = Console(stderr=True)
if not console.is_terminal:  # a log file or pipe gets whole lines and tables, not 80 squeezed columns
    console = Console(stderr=True, width=170)


class RichReporter:
    """Two bars: points of the sweep, requests of the point being measured."""

    def __init__(self, out: Console | None = None) -> None:
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=out or console, transient=False)
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
