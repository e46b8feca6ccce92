"""Placeholder: filled in by the work on issue 31 (head life after launch)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""
