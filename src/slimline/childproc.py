"""A child process's stdout, read with a deadline and then drained.

A server started as a child prints one line when it listens. Reading that line with a plain
``readline`` blocks for ever if the child hangs before printing it; never reading stdout again
afterwards lets the child block on a full pipe the first time it prints more than the pipe holds.
:class:`ChildOutput` reads on a daemon thread for the child's whole life: :meth:`wait_for` waits
for a line with a timeout, and every later line is read and dropped (the last few are kept for
error messages).
"""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections import deque

__all__ = ["ChildOutput"]

_EOF = None


class ChildOutput:
    """Reads ``proc.stdout`` (text mode) on a daemon thread until the child closes it."""

    def __init__(self, proc: subprocess.Popen[str], keep: int = 20) -> None:
        if proc.stdout is None:
            raise ValueError("ChildOutput needs a child started with stdout=subprocess.PIPE")
        self._proc = proc
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._watching = True
        self.tail: deque[str] = deque(maxlen=keep)
        self._thread = threading.Thread(target=self._read, daemon=True, name="child-stdout")
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        try:
            for line in self._proc.stdout:
                self.tail.append(line.rstrip("\n"))
                if self._watching:
                    self._lines.put(line)
        except (OSError, ValueError):  # the pipe was closed under us: the child is gone
            pass
        finally:
            self._lines.put(_EOF)

    def wait_for(self, prefix: str, timeout_s: float) -> str:
        """The rest of the first line starting with ``prefix``; later lines are drained.

        Raises :class:`TimeoutError` if no such line comes within ``timeout_s`` and
        :class:`EOFError` if the child closes its stdout (usually: exits) first.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise TimeoutError(
                    f"no line starting with {prefix!r} within {timeout_s:g} s"
                ) from None
            if line is _EOF:
                raise EOFError(f"the child closed its output before printing {prefix!r}")
            if line.startswith(prefix):
                self._watching = False  # from now on the reader only drains
                return line[len(prefix) :].strip()

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait for the reader to reach end of file (call after the child exited)."""
        self._watching = False
        self._thread.join(timeout_s)
