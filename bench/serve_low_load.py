"""Low load: p50 at 9 requests/s with the adaptive batching window against the fixed one.

Two ``slimline serve`` children serve the mnist example's model with the same flags, one with
``--fixed-delay`` (every lone request waits ``--max-queue-delay-ms`` for company) and one with
the default adaptive window (a lone request at a quiet server runs at once). Each gets the same
Poisson open-loop schedule of one-row HTTP binary requests, in alternating rounds (A B A B).

    nice -n 10 .venv/bin/python bench/serve_low_load.py [--rate 9] [--seconds 10] [--rounds 4]

Besides end-to-end p50/p99 (which a busy shared machine inflates), each server's own
``slimline_queue_duration_seconds`` gives the mean time a request waited in the batcher before
its batch started: the part the window decides.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import httpx

from serve_common import mnist_model, open_loop, payloads, save_json, write_section
from slimline.serve import run_in_subprocess

FLAGS = ["--threads", "1", "--max-batch-size", "16", "--max-queue-delay-ms", "2"]


def _queue_seconds(url: str) -> tuple[float, float]:
    """(sum, count) of the server's batcher wait histogram for the mnist model."""
    text = httpx.get(url + "/metrics", timeout=5).text
    found = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for part in found:
            if line.startswith(f'slimline_queue_duration_seconds_{part}{{model="mnist"}}'):
                found[part] = float(line.rsplit(" ", 1)[1])
    return found["sum"], found["count"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=9.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    path, rows, note = mnist_model()
    loads = payloads(rows, "binary")
    runs: dict[str, list[dict[str, Any]]] = {"fixed": [], "adaptive": []}
    with (
        run_in_subprocess([path], [*FLAGS, "--fixed-delay"]) as (fixed_url, _),
        run_in_subprocess([path], FLAGS) as (adaptive_url, _),
    ):
        for r in range(args.rounds):
            for name, url in (("fixed", fixed_url), ("adaptive", adaptive_url)):
                before = _queue_seconds(url)
                run = open_loop(url, "mnist", loads, args.rate, args.seconds, seed=r)
                after = _queue_seconds(url)
                run["queue_wait_ms"] = 1e3 * (after[0] - before[0]) / max(after[1] - before[1], 1)
                runs[name].append(run)
                print(name, round(run["p50_ms"], 2), round(run["queue_wait_ms"], 3), flush=True)
    p50 = {k: statistics.median(x["p50_ms"] for x in v) for k, v in runs.items()}
    p99 = {k: statistics.median(x["p99_ms"] for x in v) for k, v in runs.items()}
    wait = {k: statistics.median(x["queue_wait_ms"] for x in v) for k, v in runs.items()}
    save_json("low-load", {"note": note, "rate": args.rate, "runs": runs})
    lines = [
        "## Low load: the adaptive batching window",
        "",
        f"mnist example model ({note}), FP32 ONNX, `{' '.join(FLAGS)}`; {args.rate:g} one-row "
        f"HTTP binary requests/s (Poisson, open loop) for {args.seconds:g} s, {args.rounds} "
        "alternating rounds per server, medians.",
        "",
        "| window | mean wait in the batcher ms | p50 ms | p99 ms |",
        "|---|---|---|---|",
        f"| fixed (`--fixed-delay`) | {wait['fixed']:.3f} | {p50['fixed']:.2f} | "
        f"{p99['fixed']:.2f} |",
        f"| adaptive (default) | {wait['adaptive']:.3f} | {p50['adaptive']:.2f} | "
        f"{p99['adaptive']:.2f} |",
        "",
        f"The window's own cost, the mean wait in the batcher, fell by "
        f"{wait['fixed'] - wait['adaptive']:.2f} ms per request; the end-to-end p50 difference "
        f"({p50['fixed'] - p50['adaptive']:+.2f} ms) also carries the shared machine's noise. "
        "MLServer was not run in this measurement.",
        "",
        "Reproduce: `nice -n 10 .venv/bin/python bench/serve_low_load.py`",
    ]
    write_section("low-load", "\n".join(lines))


if __name__ == "__main__":
    main()
