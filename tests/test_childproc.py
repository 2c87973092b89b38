"""Reading a child's stdout with a deadline, and draining it so the child never blocks."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from slimline.childproc import ChildOutput


@contextmanager
def child(code: str) -> Iterator[tuple[subprocess.Popen[str], ChildOutput]]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    output = ChildOutput(proc)
    try:
        yield proc, output
    finally:
        proc.kill()
        proc.wait()
        output.close()
        assert proc.stdout is not None
        proc.stdout.close()


def test_a_child_that_never_prints_the_line_times_out() -> None:
    with child("import time; print('starting', flush=True); time.sleep(60)") as (_, output):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"'listening on ' within 0\.5 s"):
            output.wait_for("listening on ", 0.5)
        assert time.monotonic() - t0 < 5.0
        assert list(output.tail) == ["starting"]


def test_a_child_that_exits_first_is_end_of_file() -> None:
    with child("print('oops')") as (_, output), pytest.raises(EOFError, match="listening"):
        output.wait_for("listening on ", 30)


def test_output_after_the_line_is_drained_so_the_child_never_blocks() -> None:
    # 4 MiB after the line is far above a pipe's 64 KiB: without a reader the child would block
    code = "print('listening on http://x', flush=True); print('y' * (4 << 20), flush=True)"
    with child(code) as (proc, output):
        assert output.wait_for("listening on ", 30) == "http://x"
        assert proc.wait(timeout=30) == 0
        output.close()
        assert len(output.tail[-1]) == 4 << 20
