"""How much of the machine other work is using right now.

The load average is a poor guard for a benchmark: it is a one-minute moving average that counts
the benchmark's own recent work (a pipeline's quantize step keeps two or three threads runnable
right before the final measurement), so it cries wolf on a quiet machine and lags behind a busy
one. ``busy_cores`` instead samples the kernel's CPU counters over a short window while this
process sleeps, and subtracts what this process itself used: what is left is other work.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["busy_cores", "other_work"]

_STAT = Path("/proc/stat")


def _busy_and_total() -> tuple[int, int, int] | None:
    """(busy ticks, all ticks, ticks of processes at low priority) since boot, all cores."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return sum(ticks[:8]) - idle, sum(ticks[:8]), ticks[1]  # ticks[1]: user time at nice > 0


def busy_cores(window_s: float = 1.0) -> float | None:
    """Cores' worth of CPU used by other processes during the next ``window_s`` seconds (this
    process sleeps meanwhile; its own threads' use is subtracted). ``None`` where the kernel's
    counters are not readable (not Linux)."""
    work = other_work(window_s)
    return None if work is None else work[0]


def other_work(window_s: float = 1.0) -> tuple[float, float] | None:
    """(cores used by other processes, the part of them running at low priority) over the next
    ``window_s`` seconds. Work at nice > 0 yields the cores to a benchmark at normal priority, so
    a figure taken beside it is disturbed much less than the first number alone suggests."""
    a = _busy_and_total()
    if a is None:
        return None
    own0 = sum(os.times()[:2])
    time.sleep(window_s)
    b = _busy_and_total()
    own1 = sum(os.times()[:2])
    if b is None or b[1] <= a[1]:
        return None
    cores = os.cpu_count() or 1
    span = b[1] - a[1]
    own_cores = (own1 - own0) / window_s
    other = max(0.0, (b[0] - a[0]) / span * cores - own_cores)
    niced = (b[2] - a[2]) / span * cores - (
        own_cores if os.getpriority(os.PRIO_PROCESS, 0) > 0 else 0
    )
    return round(other, 2), round(min(other, max(0.0, niced)), 2)
