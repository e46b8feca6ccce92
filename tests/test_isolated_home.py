"""The test session's CARTSPEC_HOME (conftest ``_isolated_home``): nothing lands in the user's cache but models."""

from __future__ import annotations

import os
from pathlib import Path

from cartspec import paths


def test_the_session_home_is_temporary_and_shares_only_the_models():
    user = Path.home() / ".cache" / "cartspec"
    home = paths.home()
    assert home == Path(os.environ["CARTSPEC_HOME"]) and home.resolve() != user.resolve()
    models = paths.models_dir()
    assert models.is_symlink() and not models.resolve().is_relative_to(home.resolve())  # the user's models
    for sub in (paths.data_dir(), home / "tune", home / "draft"):
        assert sub.resolve().is_relative_to(home.resolve()), sub


def test_a_test_can_still_take_a_home_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("CARTSPEC_HOME", str(tmp_path / "home"))
    assert paths.models_dir() == tmp_path / "home" / "models" and not paths.models_dir().is_symlink()
