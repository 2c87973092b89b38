"""House limits a reader relies on: no module in ``src/slimline`` over 600 lines, no function
(or method) over 80.

The generated gRPC modules under ``serve/proto`` (``*_pb2*.py``, written by
``scripts/gen_grpc.sh`` from ``grpc_predict_v2.proto``) are left out: nobody reads or edits them,
and their length is protoc's, not ours.
"""

from __future__ import annotations

import ast
from pathlib import Path

import slimline

ROOT = Path(slimline.__file__).parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _sources(root: Path) -> list[Path]:
    return [
        f for f in sorted(root.rglob("*.py")) if not f.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    ]


def too_long(root: Path) -> list[str]:
    """Each module over :data:`MAX_MODULE_LINES` lines and each function over
    :data:`MAX_FUNCTION_LINES` (``def`` to its last line, decorators not counted) under
    ``root``, with its length."""
    found = []
    for path in _sources(root):
        text = path.read_text()
        name = path.relative_to(root).as_posix()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_or_function_in_the_package_is_too_long() -> None:
    sources = _sources(ROOT)
    assert len(sources) > 100, "the scan found too few modules"
    assert all("_pb2" not in f.name for f in sources)
    assert too_long(ROOT) == []


def test_the_length_check_finds_a_long_module_and_a_long_method(tmp_path: Path) -> None:
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # def + 80: 81
    (tmp_path / "long.py").write_text(f"class C:\n    def m(self):\n{body}")
    short = "".join(f"    y{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))  # 80: allowed
    (tmp_path / "short.py").write_text(f"def f():\n{short}")
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "big_pb2.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert too_long(tmp_path) == ["big.py: 601 lines", "long.py:2 m: 81 lines"]
