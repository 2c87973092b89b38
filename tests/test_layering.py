"""The package's import graph has no cycles, counting every import statement in a module: at
module level, inside functions (lazy imports) and under ``if TYPE_CHECKING:``.

Type-only imports count too: a type-only cycle is still a circle a reader must hold in their head,
and mypy resolves it the same way as a runtime one. Not counted: a parent package's ``__init__``
(Python runs it before any submodule; counting it would make every module depend on the package
root) and the registries' scans (:mod:`slimline.discover`), which import step and report modules
by walking their packages at run time, not by name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import slimline

ROOT = Path(slimline.__file__).parent


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names ``node`` may import, most specific first per imported name."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [prefix, *(f"{prefix}.{a.name}" for a in node.names)]


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(name, is_package, node):
                    owner = _owner(target, modules)
                    if owner is not None and owner != name:
                        edges.add(owner)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_has_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50, "the scan found too few modules"
    assert cycles(graph) == []


def test_the_registry_and_leaves_depend_only_on_leaves() -> None:
    graph = import_graph()
    leaves = {"slimline.config", "slimline.tensors", "slimline.errors", "slimline.candidate"}
    assert graph["slimline.steps"] <= leaves | {"slimline.discover"}
    assert graph["slimline.config"] == set() and graph["slimline.discover"] == set()
    assert graph["slimline.signature"] == set()
    assert graph["slimline.tensors"] == {"slimline.errors", "slimline.signature"}
    assert graph["slimline.records"] == set(), "step records are a leaf: steps and report read them"


def test_the_cycle_finder_finds_lazy_and_type_only_cycles(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n"
    )
    (pkg / "c.py").write_text("from .a import f\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg", "pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


README = ROOT.parent.parent / "README.md"
TABLE_START = "The package imports in layers."


def layer_table(readme: str) -> list[list[str]]:
    """The rungs of the README's layer table, top first: each a list of names (``a/b``,
    ``x/*``, ``__init__``), parenthesised notes dropped."""
    lines = readme[readme.index(TABLE_START) :].splitlines()
    block = lines[next(i for i, line in enumerate(lines) if line.startswith("    ")) :]
    layers: list[str] = []
    for line in block:
        if not line.startswith("    "):
            break
        if line[4] != " ":
            layers.append("")
        layers[-1] += " " + line.strip()
    rungs: list[list[str]] = []
    for layer in layers:
        text = re.sub(r"\([^)]*\)", " ", layer.split(maxsplit=1)[1])
        rungs += [part.split() for part in text.split("->")]
    return rungs


def _place(module: str, rung_of: dict[str, int]) -> str | None:
    """The table entry that places ``module``: its own name, else the nearest ``x/*``."""
    path = (
        "__init__" if module == "slimline" else module.removeprefix("slimline.").replace(".", "/")
    )
    if path in rung_of:
        return path
    parts = path.split("/")
    for end in range(len(parts), 0, -1):
        entry = "/".join(parts[:end]) + "/*"
        if entry in rung_of:
            return entry
    return None


def imports_against_the_table(
    graph: dict[str, set[str]], rungs: list[list[str]]
) -> tuple[list[str], list[str]]:
    """(modules the table does not place, imports from the same rung or below)."""
    rung_of = {name: i for i, rung in enumerate(rungs) for name in rung}
    place = {m: _place(m, rung_of) for m in graph}
    unplaced = sorted(m for m, entry in place.items() if entry is None)
    against = []
    for module, targets in sorted(graph.items()):
        here = place[module]
        for target in sorted(targets):
            there = place[target]
            if here is None or there is None or (here == there and here.endswith("/*")):
                continue
            if rung_of[there] >= rung_of[here]:
                against.append(f"{module} ({here}) imports {target} ({there})")
    return unplaced, against


def test_the_imports_follow_the_readme_layer_table() -> None:
    rungs = layer_table(README.read_text())
    names = [name for rung in rungs for name in rung]
    assert len(names) == len(set(names)), "a name is placed twice"
    assert len(rungs) > 10 and "pipeline" in names, "the table was not found"
    unplaced, against = imports_against_the_table(import_graph(), rungs)
    assert unplaced == [], "place these modules in README.md's layer table"
    assert against == []


def test_the_table_check_finds_an_upward_import_and_an_unplaced_module() -> None:
    readme = f"{TABLE_START}\n\n    low    a (notes)\n           -> b\n    high   c/*\n\nafter\n"
    rungs = layer_table(readme)
    assert rungs == [["a"], ["b"], ["c/*"]]
    graph = {
        "slimline.a": {"slimline.b"},
        "slimline.b": {"slimline.a"},
        "slimline.c.x": {"slimline.c.y", "slimline.a"},
        "slimline.c.y": set(),
        "slimline.d": set(),
    }
    unplaced, against = imports_against_the_table(graph, rungs)
    assert unplaced == ["slimline.d"]
    assert against == ["slimline.a (a) imports slimline.b (b)"]
