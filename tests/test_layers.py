"""The package's layers hold: a stage imports only the stages below it (the contract is
``[tool.importlinter]`` in pyproject.toml), and benchmarks and scripts use cartspec's public names only."""

from __future__ import annotations

import ast
import importlib.util
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
    assert "2 kept, 0 broken" in r.stdout  # the layers, and no circle inside a package


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


def _copy_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the package in which ``module`` (a path under cartspec/) ends with ``line``."""
    shutil.copytree(ROOT / "src" / "cartspec", tmp_path / "cartspec",
                    ignore=shutil.ignore_patterns("__pycache__", "assets"))
    path = tmp_path / "cartspec" / module
    path.write_text(path.read_text() + "\n" + line + "\n")
    return tmp_path


def test_a_command_module_is_held_to_its_stage(tmp_path):
    """``cartspec.<stage>.cli`` is part of its stage: ``draft/cli.py`` importing the analysis above it (as
    ``draft predict`` once did) breaks the layers; the command lives in ``analysis/cli.py``."""
    r = lint(pythonpath=_copy_with(tmp_path, "draft/cli.py", "from ..analysis import predict  # noqa: F401"))
    assert r.returncode != 0, r.stdout[-3000:]
    assert "cartspec.draft is not allowed to import cartspec.analysis" in r.stdout
    assert "cartspec.draft.cli -> cartspec.analysis.predict" in r.stdout


@pytest.mark.parametrize("module, line, package", [
    # the sweep runs the calibration and asks adaptive for schedules: adaptive importing the sweep is a circle
    ("bench/adaptive.py", "from .sweep import run_sweep  # noqa: F401", "cartspec.bench"),
    # an import inside a function is a dependency too: the head registry asking the name resolver back
    ("model/heads.py", "def _back():\n    from .registry import resolve_head  # noqa: F401", "cartspec.model"),
    ("drafting/prompt.py", "def _back():\n    from .pointer import prompt_words  # noqa: F401", "cartspec.drafting"),
    ("draft/refresh_cli.py", "def _back():\n    from .cli import app  # noqa: F401", "cartspec.draft"),
])
def test_a_circle_inside_a_package_breaks_the_contract(tmp_path, module, line, package):
    r = lint(pythonpath=_copy_with(tmp_path, module, line))
    assert r.returncode != 0, r.stdout[-3000:]
    assert f"No cycles are allowed in {package}." in r.stdout, r.stdout[-3000:]


def _import_graph():
    """scripts/import_graph.py, loaded as a module."""
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# circles the acyclic contract does not look into yet (its `skip_descendants`, pyproject.toml)
SKIPPED = ("cartspec.agent.",)


def test_no_module_imports_in_a_circle():
    """What import-linter's acyclic contract cannot see, the script does: a package's ``__init__`` and the
    modules it imports importing it back (``from . import Step`` in ``drafting/rules``) is a circle too."""
    ig = _import_graph()
    graph = ig.import_graph(ROOT / "src")
    circles = [c for c in ig.circles(graph) if not all(m.startswith(SKIPPED) for m in c)]
    assert circles == []
    assert ig.upward_imports(graph, ig.layers_contract(ROOT / "pyproject.toml")) == []


def test_the_script_sees_a_circle_through_a_package(tmp_path):
    src = _copy_with(tmp_path, "drafting/rules/agree.py", "from . import Step as _Step  # noqa: F401")
    ig = _import_graph()
    circles = ig.circles(ig.import_graph(src))
    assert any("cartspec.drafting.rules" in c and "cartspec.drafting.rules.agree" in c for c in circles), circles


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
