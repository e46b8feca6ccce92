"""Progress a person can follow: a live bar in a terminal, a line per step in a log file.

rich draws nothing live when its console is not a terminal (``nohup``, ``> run.log``, CI), so a long
step would leave the log silent for minutes. ``LoggedProgress`` is a ``rich.progress.Progress`` that,
off a terminal, prints ``description done/total (pct): info`` whenever a task crosses another tenth of
its total, finishes, or has been quiet for ``every_s`` seconds while moving.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import Progress, TaskID


class LoggedProgress(Progress):
    def __init__(self, *columns: Any, console: Console, every_s: float = 30.0, **kw: Any):
        super().__init__(*columns, console=console, **kw)
        self.plain = not console.is_terminal
        self.every_s = every_s
        self._said: dict[TaskID, tuple[int, float, float]] = {}  # task -> (tenth, completed, time) last printed

    def update(self, task_id: TaskID, **kw: Any) -> None:
        super().update(task_id, **kw)
        if self.plain:
            self._maybe_say(task_id)

    def _maybe_say(self, task_id: TaskID) -> None:
        task = self._tasks[task_id]
        total, done = task.total, task.completed
        tenth = int(10 * done / total) if total else 0
        last_tenth, last_done, last_t = self._said.get(task_id, (0, 0.0, time.monotonic()))
        now = time.monotonic()
        moved = done != last_done
        if moved and (tenth > last_tenth or (total and done >= total) or now - last_t >= self.every_s):
            pct = f" ({100 * done / total:.0f}%)" if total else ""
            info = task.fields.get("info")
            self.console.print(f"{task.description} {done:g}/{total:g}{pct}" + (f": {info}" if info else ""),
                               highlight=False)
            self._said[task_id] = (tenth, done, now)
        elif task_id not in self._said:
            self._said[task_id] = (tenth, done, now)
