"""The ``cartspec draft`` commands' terminal: one console (stderr), an error that exits with status 2, and the
progress bar of a long job (a bar in a terminal, a line per tenth of the work in a log file). Shared by
``draft/cli.py`` and the commands it registers (``draft/refresh_cli.py``)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..progress import LoggedProgress

console = Console(stderr=True)


def fail(msg: str, code: int = 2) -> None:
    """Print ``msg`` as an error and exit with ``code``."""
    console.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code)


def progress() -> Progress:
    """A bar in a terminal; a line per tenth of the work (or per 30 s) in a log file."""
    return LoggedProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console, transient=False)
