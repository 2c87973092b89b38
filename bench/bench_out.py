"""Shared tail of the measurement scripts: the command that reproduces a result, what a check
found, and writing the result (markdown printed, and with ``--out`` the markdown and its JSON
beside it, atomically).

A script states a result only from what it measured in the run that writes it: a figure it did
not get renders as :data:`NOT_MEASURED` (:func:`figure`), and a sentence that a check supports
renders only when that check passed (:func:`claim`); a failed or skipped check writes "not
measured" and why, never the sentence.
"""

from __future__ import annotations

import json
import shlex
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from slimline.record import atomic_write_text

NOT_MEASURED = "not measured"

Status = Literal["passed", "failed", "skipped"]


@dataclass(frozen=True)
class Check:
    """The outcome of one check a script ran: what it saw (``detail``), or why it did not."""

    name: str
    status: Status
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_check(name: str, check: Callable[[], tuple[bool, str]]) -> Check:
    """Run ``check`` (returns (passed, what it saw)); an exception makes a failed check with the
    error as its detail, not a crash that loses the other checks' results."""
    try:
        ok, detail = check()
    except Exception as err:  # the check's own failure is its result
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        return Check(name, "failed", last)
    return Check(name, "passed" if ok else "failed", detail)


def skipped(name: str, why: str) -> Check:
    return Check(name, "skipped", why)


def claim(check: Check, sentence: str) -> str:
    """``sentence`` with what the check saw when it passed; else "not measured" and why."""
    if check.passed:
        return f"{sentence} ({check.detail})" if check.detail else sentence
    why = f"{check.status}: {check.detail}" if check.detail else check.status
    return f"{check.name}: {NOT_MEASURED} ({why})"


def figure(value: float | int | None, fmt: str = ".3f", unit: str = "") -> str:
    """``value`` formatted, or :data:`NOT_MEASURED` when the run did not measure it."""
    if value is None:
        return NOT_MEASURED
    return f"{format(value, fmt)}{unit}"


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
        atomic_write_text(out.with_suffix(".json"), json.dumps(doc, indent=1, default=str))


def put_section(text: str, key: str, body: str) -> str:
    """``text`` with the section between ``<!-- key -->`` and ``<!-- /key -->`` replaced by
    ``body`` (appended at the end when the markers are not there yet)."""
    start, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text:
        head, rest = text.split(start, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip() + "\n\n" + block + "\n"
