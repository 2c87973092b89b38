from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from slimline.measure import host
from slimline.measure.host import busy_cores


def _spin_thread(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_busy_cores_counts_other_processes_and_not_our_own_threads() -> None:
    base = busy_cores(0.5)
    assert base is not None
    if base > (os.cpu_count() or 1) - 1.3:
        pytest.skip(f"other work already uses {base} cores: no spare core to observe")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        seen = busy_cores(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert seen is not None and seen >= base + 0.6, (base, seen)  # about one more core
    stop = threading.Event()
    t = threading.Thread(target=_spin_thread, args=(stop,))
    t.start()
    try:
        own = busy_cores(1.0)  # this process spins a core meanwhile: not other work
    finally:
        stop.set()
        t.join()
    assert own is not None and own <= base + 0.4, (base, own)


def test_other_work_tells_low_priority_work_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    # the kernel's counters over one window: 1,000 ticks over all cores, 500 of them busy,
    # 250 of those at nice > 0 (this process sleeps meanwhile, so none of it is its own)
    ticks = iter([(1_000, 4_000, 100), (1_500, 5_000, 350)])
    monkeypatch.setattr(host, "_busy_and_total", lambda: next(ticks))
    cores = os.cpu_count() or 1
    assert host.other_work(0.01) == (round(0.5 * cores, 2), round(0.25 * cores, 2))
