"""Measure cartspec's import graph: circles between modules and imports that go up the stage layers.

    .venv/bin/python scripts/import_graph.py [--src src] [--json]

Reads every module under src/cartspec with ``ast`` (nothing is imported), counting every import statement:
module level, inside functions, and under ``if TYPE_CHECKING:`` alike, since each is still a dependency.
``from cartspec.x import y`` is an edge to ``cartspec.x.y`` when that is a module, else to ``cartspec.x``.

It reports
- circles: each group of modules that reach one another (a strongly connected component of more than one
  module), with the edges inside it;
- upward imports: an edge from a package (or module) in pyproject.toml's import-linter ``layers`` contract to
  one listed above it, or between two ``|`` siblings; the contract's ``ignore_imports`` are *not* applied
  here, and the ones that an ignore entry would hide are marked.

Exit status 1 when there is a circle or an upward import, else 0.
"""

from __future__ import annotations

import argparse
import ast
import re
import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_files(src: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``src``, by dotted name (a package is its ``__init__``)."""
    found = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name an ``ImportFrom`` reads from (relative levels resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: set[str], package: str) -> set[str]:
    """The modules of ``package`` that ``module`` imports anywhere in its source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for name in names:
            if name != package and not name.startswith(package + "."):
                continue
            while name not in modules and "." in name:  # `import cartspec.x.Name` style: the nearest module
                name = name.rsplit(".", 1)[0]
            if name != module:
                targets.add(name)
    return targets


def import_graph(src: Path, package: str = "cartspec") -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    files = module_files(src, package)
    return {m: imports_of(m, p, set(files), package) for m, p in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _layer_of(module: str, layers: list[list[str]], package: str) -> tuple[int, str] | None:
    """(layer index, the layer member that holds ``module``), or None when it is in no layer."""
    for i, members in enumerate(layers):
        for member in members:
            name = f"{package}.{member}"
            if module == name or module.startswith(name + "."):
                return i, member
    return None


def upward_imports(graph: dict[str, set[str]], contract: dict, package: str = "cartspec") -> list[dict]:
    """Edges that break the layers contract: to a layer above, or between two independent siblings."""
    layers = [[m.strip() for m in entry.split("|")] for entry in contract["layers"]]
    ignores = contract.get("ignore_imports", [])
    found = []
    for source in sorted(graph):
        here = _layer_of(source, layers, package)
        if here is None:
            continue
        for target in sorted(graph[source]):
            there = _layer_of(target, layers, package)
            if there is None:
                continue
            upward = there[0] < here[0]
            siblings = there[0] == here[0] and there[1] != here[1] and "|" in contract["layers"][here[0]]
            if upward or siblings:
                hidden_by = [i for i in ignores if _ignore_matches(i, source, target)]
                found.append({"from": source, "to": target, "kind": "upward" if upward else "siblings",
                              "hidden_by": hidden_by})
    return found


def _ignore_matches(entry: str, source: str, target: str) -> bool:
    """Whether an import-linter ``ignore_imports`` entry (``a -> b`` with ``*``/``**``) covers the edge."""
    left, right = (side.strip() for side in entry.split("->"))

    def matches(pattern: str, name: str) -> bool:
        regex = pattern.replace(".", r"\.").replace("**", "\0").replace("*", "[^.]+").replace("\0", ".+")
        return re.fullmatch(regex, name) is not None

    return matches(left, source) and matches(right, target)


def layers_contract(pyproject: Path) -> dict:
    """The ``layers`` contract over the whole package in pyproject.toml's ``[tool.importlinter]``."""
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    for contract in config["contracts"]:
        if contract["type"] == "layers" and contract.get("containers") == [config["root_package"]]:
            return contract
    raise SystemExit(f"no `layers` contract over {config['root_package']} in {pyproject}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the folder that holds cartspec/")
    ap.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    ap.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    args = ap.parse_args()
    graph = import_graph(args.src)
    found_circles = circles(graph)
    found_upward = upward_imports(graph, layers_contract(args.pyproject))
    if args.json:
        print(json.dumps({"modules": len(graph), "edges": sum(map(len, graph.values())),
                          "circles": [{"modules": c, "edges": [[a, b] for a in c for b in sorted(graph[a]) if b in c]}
                                      for c in found_circles],
                          "upward_imports": found_upward}, indent=1))
    else:
        print(f"{len(graph)} modules, {sum(map(len, graph.values()))} import edges")
        print(f"circles: {len(found_circles)}")
        for c in found_circles:
            print("  " + " | ".join(c))
            for a in c:
                for b in sorted(graph[a]):
                    if b in c:
                        print(f"      {a} -> {b}")
        print(f"upward imports: {len(found_upward)}")
        for u in found_upward:
            hidden = f"  (hidden by ignore {', '.join(u['hidden_by'])})" if u["hidden_by"] else ""
            print(f"  {u['from']} -> {u['to']}  [{u['kind']}]{hidden}")
    return 1 if found_circles or found_upward else 0


if __name__ == "__main__":
    sys.exit(main())
