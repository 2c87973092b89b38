"""Shared tail of the measurement scripts: the command that reproduces a result, and writing the
result (markdown printed, and with ``--out`` the markdown and its JSON beside it, atomically)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from slimline.record import atomic_write_text


def reproduce_command(script: str, argv: list[str] | None) -> str:
    """The command line that produced this result, quoted so that it can be pasted back."""
    return f".venv/bin/python bench/{script} " + shlex.join(sys.argv[1:] if argv is None else argv)


def reproduce_footer(cmd: str) -> list[str]:
    """The markdown lines that end every result: how to produce it again."""
    return ["", "Reproduce:", "", f"    {cmd}", ""]


def publish(text: str, doc: dict[str, Any], out: Path | None) -> None:
    print(text)
    if out is not None:
        atomic_write_text(out, text)
        atomic_write_text(out.with_suffix(".json"), json.dumps(doc, indent=1))
