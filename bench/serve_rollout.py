"""A rollout under load: version 2 of a model loaded while open-loop traffic flows.

``slimline serve --repository DIR`` serves the mnist example's model as version 1. An open-loop
Poisson load of one-row HTTP binary requests runs for ``--seconds``; a third of the way in,
version 2 (the same graph) is written into the repository and ``POST
/v2/repository/models/mnist/load`` rolls it out: loaded, warmed at every batch size beside
version 1, made the default, version 1 retired once its requests are answered. Reported: failed
requests, and p99 of the requests scheduled before the load call, during it (until the call
returned), and after it.

    nice -n 10 .venv/bin/python bench/serve_rollout.py [--rate 100] [--seconds 24]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from serve_common import mnist_model, payloads, save_json, write_section
from slimline.loadtest.client import OUTCOMES, HttpClient
from slimline.loadtest.generator import START_MARGIN_S, OpenPlan, execute
from slimline.serve import run_in_subprocess


def _p99(lat: np.ndarray) -> float | None:
    return float(np.percentile(lat, 99)) if lat.size else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=24.0)
    args = ap.parse_args()
    path, rows, note = mnist_model()
    loads = payloads(rows, "binary")
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        (repo / "mnist" / "1").mkdir(parents=True)
        shutil.copy(path, repo / "mnist" / "1" / "model.onnx")
        flags = ["--repository", str(repo), "--threads", "1", "--max-batch-size", "16"]
        with run_in_subprocess([], flags) as (url, _):
            rng = np.random.default_rng(0)
            offsets = np.cumsum(rng.exponential(1 / args.rate, int(args.rate * args.seconds * 1.3)))
            offsets = offsets[offsets < args.seconds]
            plan = OpenPlan(offsets, np.arange(len(offsets)) % len(loads))
            swap: dict[str, float] = {}

            def roll_out(t0: float) -> None:
                time.sleep(max(0.0, t0 + args.seconds / 3 - time.monotonic()))
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
    ok = rec.outcome == OUTCOMES.index("ok")
    lat = (rec.done - rec.scheduled) * 1e3
    before = ok & (rec.scheduled < swap["start"])
    during = ok & (rec.scheduled >= swap["start"]) & (rec.scheduled <= swap["end"])
    after = ok & (rec.scheduled > swap["end"])
    failed = int((~ok).sum())
    doc: dict[str, Any] = {
        "requests": len(ok), "failed": failed, "swap": swap, "note": note,
        "p99_ms": {"before": _p99(lat[before]), "during": _p99(lat[during]),
                   "after": _p99(lat[after])},
    }  # fmt: skip
    save_json("rollout", doc)
    p99 = doc["p99_ms"]
    lines = [
        "## A rollout under load",
        "",
        f"mnist example model ({note}) served from a repository (`--threads 1 --max-batch-size "
        f"16`); {args.rate:g} one-row HTTP binary requests/s, Poisson open loop, {args.seconds:g}"
        f" s; version 2 written and `POST /v2/repository/models/mnist/load` called at "
        f"{swap['start']:.1f} s (answered {swap['status']} after "
        f"{swap['end'] - swap['start']:.2f} s: load, warm-up, switch, retire version 1).",
        "",
        "| requests | failed | p99 before ms | p99 during the load call ms | p99 after ms |",
        "|---|---|---|---|---|",
        f"| {len(ok)} | {failed} | {p99['before']:.1f} | {p99['during']:.1f} | "
        f"{p99['after']:.1f} |",
        "",
        "Reproduce: `nice -n 10 .venv/bin/python bench/serve_rollout.py`",
    ]
    write_section("rollout", "\n".join(lines))


if __name__ == "__main__":
    main()
