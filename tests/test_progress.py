"""Long steps print progress lines into a log file, where rich draws no live bar."""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import TextColumn

from cartspec.progress import LoggedProgress


def _run(terminal: bool) -> list[str]:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=terminal, width=200)
    with LoggedProgress(TextColumn("{task.description}"), console=console) as pg:
        task = pg.add_task("features", total=40, info="")
        for i in range(1, 41):
            pg.update(task, completed=i, info=f"record {i}")
    return [ln for ln in buf.getvalue().splitlines() if ln.strip()]


def test_a_log_file_gets_a_line_per_tenth_of_the_work():
    lines = [ln for ln in _run(terminal=False) if "%" in ln]  # rich adds its last frame, the bare columns
    assert lines[0] == "features 4/40 (10%): record 4"
    assert lines[-1] == "features 40/40 (100%): record 40"
    assert len(lines) == 10  # one per tenth, not one per update


def test_a_terminal_gets_the_bar_not_the_lines():
    assert not any("(10%)" in ln for ln in _run(terminal=True))
