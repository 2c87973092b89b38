"""Low load and the knee, side by side with MLServer (issue 28's last target).

``slimline serve`` and MLServer (``bench/serve_mlserver.py``: its own venv, a separate process)
serve the same INT8 mnist ONNX file with the same ONNX Runtime threads and the same batching
limits (16 rows, 2 ms). MLServer runs in two configurations, so that slimline meets the better
of them on each measure: ``parallel_workers=0`` (inference in the server's process, its lowest
latency) and ``parallel_workers=1`` (its default: one inference worker process).

1. Low load: 9 one-row requests/s (Poisson, open loop, latency from the scheduled time), the
   same schedule to each server in alternating rounds; median p50 over the rounds.
2. The knee: the same sweep of offered rates for each server, interleaved per rate; the knee
   is the highest rate that, with every rate below it, keeps the median p99 within 50 ms with
   under 1% of requests failing; a server that failed a step is not sent the higher rates.

Both over JSON with slimline's load generator (MLServer has no binary tensor extension).

Run by ``bench/serve_platform.py`` (``--only low-load``); measurement only, no results file.
"""

from __future__ import annotations

import statistics
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from serve_common import open_loop, payloads
from serve_grpc import knee, merge_rounds, passes, shown_knee, step_rows
from serve_mlserver import mlserver
from slimline.serve import run_in_subprocess

FLAGS = ["--threads", "2", "--max-batch-size", "16", "--max-queue-delay-ms", "2"]
SERVERS = ("slimline", "mlserver-w0", "mlserver-w1")
NAMES = {
    "slimline": "slimline",
    "mlserver-w0": "MLServer, `parallel_workers=0`",
    "mlserver-w1": "MLServer, `parallel_workers=1`",
}


def measure(path: Path, rows: dict[str, np.ndarray], mlserver_bin: Path, *, rate: float,
            seconds: float, rounds: int, rates: list[float], knee_rounds: int,
            step_s: float) -> dict[str, Any]:  # fmt: skip
    loads = payloads(rows, "json")
    low: dict[str, list[dict[str, Any]]] = {s: [] for s in SERVERS}
    steps: dict[str, list[dict[str, Any]]] = {s: [] for s in SERVERS}
    with ExitStack() as stack:
        urls = {"slimline": stack.enter_context(run_in_subprocess([path], FLAGS))[0]}
        for workers in (0, 1):
            url, _ = stack.enter_context(mlserver(
                mlserver_bin, path, "mnist", threads=2, max_batch_size=16,
                max_batch_time_s=0.002, parallel_workers=workers))  # fmt: skip
            urls[f"mlserver-w{workers}"] = url
        for r in range(rounds):
            for name in SERVERS[r % 3 :] + SERVERS[: r % 3]:
                low[name].append(open_loop(urls[name], "mnist", loads, rate, seconds, seed=r))
            print("low", r, {s: round(low[s][-1]["p50_ms"], 2) for s in SERVERS}, flush=True)
        for step in rates:
            going = [s for s in SERVERS if not steps[s] or passes(steps[s][-1])]
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in going}
            for r in range(knee_rounds):
                for name in going[r % len(going) :] + going[: r % len(going)]:
                    run = open_loop(urls[name], "mnist", loads, step, step_s, seed=100 + r)
                    run["offered_rps"] = step
                    runs[name].append(run)
            for name, got in runs.items():
                steps[name].append(merge_rounds(got))
            print("knee", step, {s: round(steps[s][-1]["p99_ms"], 1) for s in going}, flush=True)
            if not runs:
                break
    p50 = {s: statistics.median(x["p50_ms"] for x in v) for s, v in low.items()}
    return {"flags": FLAGS, "rate": rate, "seconds": seconds, "rounds": rounds,
            "knee_rounds": knee_rounds, "step_s": step_s, "low": low, "p50_ms": p50,
            "steps": steps, "knees": {s: knee(v) for s, v in steps.items()}}  # fmt: skip


def best_peer(values: dict[str, float | None], lower_is_better: bool) -> tuple[str, float | None]:
    """The better MLServer configuration on a measure, and its value."""
    peers = [(s, v) for s, v in values.items() if s != "slimline" and v is not None]
    if not peers:
        return "none", None
    pick = min if lower_is_better else max
    return pick(peers, key=lambda sv: sv[1])


def render(part: dict[str, Any]) -> list[str]:
    p50 = part["p50_ms"]
    low_cells = [f"{statistics.median(x['p99_ms'] for x in part['low'][s]):.2f}" for s in SERVERS]
    lines = [
        f"Same INT8 mnist file ({part['model']}) behind each server, ONNX Runtime 2 threads, "
        f"batches of up to 16 rows within 2 ms everywhere (slimline: `{' '.join(part['flags'])}`"
        "); slimline's load generator, JSON tensors. Low load: "
        f"{part['rate']:g} one-row requests/s for {part['seconds']:g} s, {part['rounds']} "
        "rounds in rotating order. Knee: "
        f"{part['step_s']:g} s per step after 1 s of warm-up, {part['knee_rounds']} rounds, "
        "median p99 per step.",
        "",
        "| server | p50 at low load ms (rounds) | p99 at low load ms | knee req/s |",
        "|---|---|---|---|",
    ]
    for s, p99 in zip(SERVERS, low_cells, strict=True):
        rounds = ", ".join(f"{x['p50_ms']:.2f}" for x in part["low"][s])
        shown = shown_knee(part["steps"][s])
        lines.append(f"| {NAMES[s]} | **{p50[s]:.2f}** ({rounds}) | {p99} | **{shown}** |")
    lines += ["", "| offered req/s | " + " | ".join(f"{NAMES[s]} p50 / p99 ms" for s in SERVERS)
              + " |", "|---|" + "---|" * len(SERVERS)]  # fmt: skip
    lines += step_rows(part["steps"], SERVERS)
    return lines
