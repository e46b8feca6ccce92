"""The package's layers hold: a stage imports only the stages below it (the contract is
``[tool.importlinter]`` in pyproject.toml), and benchmarks and scripts use cartspec's public names only."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    if not LINT.exists():
        pytest.fail(f"{LINT} missing: install the test extra (`pip install -e '.[test]'`, scripts/install.sh does)")
    env = {**os.environ, "PYTHONPATH": str(pythonpath)} if pythonpath else None
    # --no-cache: a cached graph of another tree must never answer for this one
    return subprocess.run([str(LINT), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_package_keeps_its_layers():
    r = lint()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 kept, 0 broken" in r.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The check is real: the same contract over a copy of the package in which the task layer imports the
    report fails, and names that import."""
    shutil.copytree(ROOT / "src" / "cartspec", tmp_path / "cartspec",
                    ignore=shutil.ignore_patterns("__pycache__", "assets"))
    init = tmp_path / "cartspec" / "task" / "__init__.py"
    init.write_text(init.read_text() + "\nfrom ..report import build  # noqa: F401  (an upward import)\n")
    r = lint(pythonpath=tmp_path)
    assert r.returncode != 0, r.stdout[-3000:]
    assert "cartspec.task is not allowed to import cartspec.report" in r.stdout
    assert "cartspec.task -> cartspec.report.build" in r.stdout


def _private_imports(path: Path) -> list[str]:
    """``from cartspec... import _name`` and ``module._name`` of a module imported from cartspec."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cartspec"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{path.name}:{node.lineno} from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("cartspec"):
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_benchmarks_and_scripts_use_public_names_only():
    files = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    assert files
    private = [hit for f in files for hit in _private_imports(f)]
    assert not private, "private cartspec names used outside the package:\n" + "\n".join(private)


def test_the_private_name_check_sees_both_forms(tmp_path):
    f = tmp_path / "bench.py"
    f.write_text("from cartspec.task import novel\nfrom cartspec.x import _hidden, shown\nnovel._substitute(1)\n")
    assert _private_imports(f) == ["bench.py:2 from cartspec.x import _hidden", "bench.py:3 novel._substitute"]


def test_no_name_is_used_that_is_never_defined():
    """A name used but never bound (a function-level import forgotten in one of two functions) fails only on
    the path that runs it, often a vLLM integration test; pyflakes finds it in every module at once."""
    r = subprocess.run([sys.executable, "-m", "pyflakes", "src", "benchmarks", "scripts", "tests"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    if "No module named pyflakes" in r.stderr:
        pytest.fail("pyflakes missing: install the test extra (`pip install -e '.[test]'`, scripts/install.sh does)")
    undefined = [line for line in r.stdout.splitlines() if "undefined name" in line or "may be undefined" in line]
    assert not undefined, "\n".join(undefined)
