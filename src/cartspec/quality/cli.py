"""The paired quality tests on the terminal: their table (``print_quality``) and the run after a study's sweep
(``quality_after_study``). The ``cartspec quality`` command, which ends by rebuilding the report, is in
``report/cli.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rich.console import Console

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
