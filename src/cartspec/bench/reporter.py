"""What a sweep tells the outside world while it runs: the ``Reporter`` protocol and its quiet forms.

``cartspec study`` passes a rich progress display (``bench/cli.py``); tests and calibrations pass these.
"""

from __future__ import annotations

from typing import Protocol

from ..results import PointConfig, PointResult


class Reporter(Protocol):
    """What the sweep tells the outside world (a rich progress display, or nothing)."""

    def start(self, total: int, done: int) -> None: ...
    def deployment(self, label: str, state: str) -> None: ...
    def point_started(self, cfg: PointConfig, part: int = 0) -> None: ...  # part: the slice (points in rounds)
    def request_done(self, ok: bool) -> None: ...
    def point_finished(self, res: PointResult) -> None: ...
    def stop(self) -> None: ...


class SilentReporter:
    def start(self, total, done): pass
    def deployment(self, label, state): pass
    def point_started(self, cfg, part=0): pass
    def request_done(self, ok): pass
    def point_finished(self, res): pass
    def stop(self): pass


class NestedReporter(SilentReporter):
    """A sweep inside a sweep (a calibration): one line per deployment and point, the outer bars untouched."""

    def __init__(self, outer: Reporter, what: str):
        self.outer, self.what = outer, what

    def deployment(self, label, state):
        self.outer.deployment(f"{self.what} {label}", state)

    def point_finished(self, res):
        c = res.config
        tput = f"{res.output_throughput:.1f} tok/s" if res.output_throughput else res.reason or res.status
        self.outer.deployment(f"{self.what} {c.deployment}", f"{c.load} T={c.temperature:g}: {tput}")
