"""A rollout under load: version 2 of a model loaded while open-loop traffic flows.

``slimline serve --repository DIR`` serves the INT8 mnist model as version 1. An open-loop
Poisson load of one-row HTTP binary requests runs for ``seconds``; a third of the way in,
version 2 (the same file) is written into the repository and ``POST
/v2/repository/models/mnist/load`` rolls it out: loaded, warmed at every batch size beside
version 1, made the default, version 1 retired once its requests are answered. Reported: failed
requests, and the p99 of the requests scheduled before the load call (the steady state), during
it (until the call returned) and after it, each as a ratio to the steady state.

Run by ``bench/serve_platform.py`` (``--only rollout``); measurement only, no results file.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from serve_common import payloads
from slimline.loadtest.client import OUTCOMES, HttpClient
from slimline.loadtest.generator import START_MARGIN_S, OpenPlan, execute
from slimline.serve import run_in_subprocess

FLAGS = ["--threads", "2", "--max-batch-size", "16", "--max-queue-delay-ms", "2"]


def _p99(lat: np.ndarray) -> float | None:
    return float(np.percentile(lat, 99)) if lat.size else None


def measure(path: Path, rows: dict[str, np.ndarray], rate: float, seconds: float) -> dict[str, Any]:
    loads = payloads(rows, "binary")
    swap: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        (repo / "mnist" / "1").mkdir(parents=True)
        shutil.copy(path, repo / "mnist" / "1" / "model.onnx")
        with run_in_subprocess([], ["--repository", str(repo), *FLAGS]) as (url, _):
            rng = np.random.default_rng(0)
            offsets = np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 1.3)))
            offsets = offsets[offsets < seconds]
            plan = OpenPlan(offsets, np.arange(len(offsets)) % len(loads))

            def roll_out(t0: float) -> None:
                time.sleep(max(0.0, t0 + seconds / 3 - time.monotonic()))
                (repo / "mnist" / "2").mkdir()
                shutil.copy(path, repo / "mnist" / "2" / "model.onnx")
                swap["start"] = time.monotonic() - t0
                answer = httpx.post(f"{url}/v2/repository/models/mnist/load", timeout=120)
                swap["end"] = time.monotonic() - t0
                swap["status"] = answer.status_code

            t0 = time.monotonic() + START_MARGIN_S  # the generator's own t0, give or take
            roller = threading.Thread(target=roll_out, args=(t0,))
            roller.start()
            rec = execute(lambda: HttpClient(url, "mnist", timeout_s=30), plan, loads,
                          connections=64)  # fmt: skip
            roller.join()
            version = httpx.get(f"{url}/v2/models/mnist").json()["versions"]
    ok = rec.outcome == OUTCOMES.index("ok")
    lat = (rec.done - rec.scheduled) * 1e3
    phases = {
        "before": ok & (rec.scheduled < swap["start"]),
        "during": ok & (rec.scheduled >= swap["start"]) & (rec.scheduled <= swap["end"]),
        "after": ok & (rec.scheduled > swap["end"]),
        "just_after": ok & (rec.scheduled > swap["end"]) & (rec.scheduled <= swap["end"] + 2),
    }
    p99 = {k: _p99(lat[m]) for k, m in phases.items()}
    steady = p99["before"]
    return {"flags": FLAGS, "rate": rate, "seconds": seconds, "requests": len(ok),
            "failed": int((~ok).sum()), "swap": swap, "versions_after": version, "p99_ms": p99,
            "counts": {k: int(m.sum()) for k, m in phases.items()},
            "ratio": {k: (v / steady if v is not None and steady else None)
                      for k, v in p99.items()}}  # fmt: skip


def render(part: dict[str, Any]) -> list[str]:
    p99, ratio, swap = part["p99_ms"], part["ratio"], part["swap"]
    lines = [
        f"`slimline serve --repository DIR {' '.join(part['flags'])}` serving {part['model']} as"
        f" version 1; {part['rate']:g} one-row HTTP binary requests/s, Poisson open loop, "
        f"{part['seconds']:g} s; version 2 written and `POST /v2/repository/models/mnist/load` "
        f"called at {swap['start']:.1f} s, answered {swap['status']:.0f} after "
        f"{swap['end'] - swap['start']:.2f} s (load, warm-up, switch, retire version 1); "
        f"versions served after: {', '.join(part['versions_after'])}.",
        "",
        "| requests | failed | p99 before (steady state) ms | p99 during the load call ms | "
        "p99 in the 2 s after it ms | p99 after ms |",
        "|---|---|---|---|---|---|",
        f"| {part['requests']} | **{part['failed']}** | {p99['before']:.1f} "
        f"({part['counts']['before']} requests) | {p99['during']:.1f} "
        f"(**{ratio['during']:.2f}x** steady; {part['counts']['during']} requests) | "
        f"{p99['just_after']:.1f} ({ratio['just_after']:.2f}x) | "
        f"{p99['after']:.1f} ({ratio['after']:.2f}x) |",
    ]
    return lines
