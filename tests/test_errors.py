"""One error tree: every exception class of the package is defined in :mod:`slimline.errors`,
derives from ``SlimlineError``, is drawn in that module's docstring under its real parent, and
is raised (a leaf) or caught (a branch) somewhere. The scan reads the source, so it needs none
of the optional runtimes that some modules import."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import slimline
from slimline import errors
from slimline.errors import SlimlineError

ROOT = Path(slimline.__file__).parent
ERRORS = ROOT / "errors.py"
BUILTIN_EXCEPTIONS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}


def _tree_classes() -> dict[str, type[BaseException]]:
    return {
        name: value
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }


def _sources() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(ROOT.rglob("*.py"))}


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else ast.unparse(node)


def exception_classes_outside_errors(sources: dict[Path, ast.Module]) -> list[str]:
    """``module:Class`` for each class outside errors.py that derives from an exception,
    through builtins, the tree's names or other such classes (to a fixed point)."""
    known = BUILTIN_EXCEPTIONS | set(_tree_classes())
    found: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for path, tree in sources.items():
            if path == ERRORS:
                continue
            for node in ast.walk(tree):
                if not isinstance(node, ast.ClassDef) or node.name in found:
                    continue
                if any(_base_name(b) in known for b in node.bases):
                    found[node.name] = f"{path.relative_to(ROOT)}:{node.name}"
                    known.add(node.name)
                    changed = True
    return sorted(found.values())


def test_every_exception_class_is_defined_in_errors_py() -> None:
    assert exception_classes_outside_errors(_sources()) == []


def test_the_scan_finds_an_exception_class_defined_elsewhere() -> None:
    tree = ast.parse("class Mine(ValueError): ...\nclass Theirs(Mine): ...\nclass Plain: ...\n")
    fake = ROOT / "fake_module_for_the_scan.py"  # never written: the scan reads the tree given
    assert exception_classes_outside_errors({fake: tree}) == [
        "fake_module_for_the_scan.py:Mine",
        "fake_module_for_the_scan.py:Theirs",
    ]


def test_every_class_in_errors_derives_from_slimline_error() -> None:
    outside = [n for n, c in _tree_classes().items() if not issubclass(c, SlimlineError)]
    assert outside == []
    assert set(_tree_classes()) <= set(errors.__all__)


def _drawn_tree() -> dict[str, str | None]:
    """Class -> parent, read from the tree drawn in errors.py's docstring."""
    doc = errors.__doc__ or ""
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        match = re.match(r"^(\s*[│ ]*(?:[├└]── )?)([A-Z]\w+)\s{2,}", line)
        if match is None or not line.startswith("    "):
            continue
        depth = len(match.group(1))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[match.group(2)] = stack[-1][1] if stack else None
        stack.append((depth, match.group(2)))
    return parents


def test_the_drawn_tree_is_the_real_tree() -> None:
    drawn = _drawn_tree()
    real = {
        name: (None if cls is SlimlineError else cls.__mro__[1].__name__)
        for name, cls in _tree_classes().items()
    }
    assert drawn == real


def _names_used(sources: dict[Path, ast.Module]) -> tuple[set[str], set[str]]:
    """Names called (constructed) and names referenced at all, outside errors.py."""
    called: set[str] = set()
    referenced: set[str] = set()
    for path, tree in sources.items():
        if path == ERRORS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                referenced.add(node.id)
            elif isinstance(node, ast.Attribute):
                referenced.add(node.attr)
            if isinstance(node, ast.Call):
                called.add(_base_name(node.func))
    return called, referenced


def test_every_leaf_is_raised_and_every_branch_is_caught_somewhere() -> None:
    called, referenced = _names_used(_sources())
    classes = _tree_classes()
    branches = {c.__mro__[1].__name__ for c in classes.values()}
    never_raised = sorted(n for n in classes if n not in branches and n not in called)
    never_used = sorted(n for n in branches & set(classes) if n not in referenced)
    assert never_raised == [] and never_used == []
