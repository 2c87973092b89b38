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

__all__ = ["busy_cores"]

_STAT = Path("/proc/stat")


def _busy_and_total() -> tuple[int, int] | None:
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return sum(ticks[:8]) - idle, sum(ticks[:8])


def busy_cores(window_s: float = 1.0) -> float | None:
    """Cores' worth of CPU used by other processes during the next ``window_s`` seconds (this
    process sleeps meanwhile; its own threads' use is subtracted). ``None`` where the kernel's
    counters are not readable (not Linux)."""
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
    busy_share = (b[0] - a[0]) / (b[1] - a[1])  # of all cores
    own_cores = (own1 - own0) / window_s
    return round(max(0.0, busy_share * cores - own_cores), 2)
