"""Throughput under concurrency: the server with dynamic batching against the in-process engine
at its best batch size (goal: at least 0.9x).

In-process: ``session.run`` in a loop at batch 1..64 (2 intra-op threads, spinning on and off;
the best of all is the reference), measured before and after the server runs and averaged, so
drift of the shared machine hits both sides. Server: a child process with the same threads,
closed-loop load of single-row requests (binary tensors) from slimline's load generator, which
runs on the same 2 cores and so takes CPU from the server: the ratio is a lower bound.

    nice -n 10 .venv/bin/python bench/serve_throughput.py [--seconds 10]
"""

from __future__ import annotations

import argparse
from typing import Any

from serve_common import (
    MODELS,
    closed_loop,
    in_process_throughput,
    payloads,
    save_json,
    write_section,
)
from slimline.serve import run_in_subprocess
from slimline.serve.model import ort_serving_session

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def engine_best(path: Any, rows: dict, seconds: float) -> tuple[float, int, bool]:
    best = (0.0, 1, False)
    for spinning in (False, True):
        sess = ort_serving_session(path, 2, spinning=spinning)
        for b in BATCHES:
            rps = in_process_throughput(sess, rows, b, seconds)
            best = max(best, (rps, b, spinning))
        del sess
    return best


def engine_at(path: Any, rows: dict, batch: int, spinning: bool, seconds: float) -> float:
    sess = ort_serving_session(path, 2, spinning=spinning)
    return in_process_throughput(sess, rows, batch, seconds)


def measure(name: str, seconds: float) -> dict[str, Any]:
    path, rows, note = MODELS[name]()
    before, batch, spinning = engine_best(path, rows, 1.5)
    loads = payloads(rows, "binary")
    servers = []
    for instances, threads in ((1, 2), (2, 1)):
        max_batch = min(max(8, batch), 64)
        flags = ["--threads", str(threads), "--instances", str(instances),
                 "--max-batch-size", str(max_batch), "--max-queue-delay-ms", "2",
                 "--max-queue-size", "512", "--timeout-ms", "60000"]  # fmt: skip
        concurrency = 2 * max_batch * instances
        with run_in_subprocess([path], flags) as (url, _):
            res = closed_loop(url, name, loads, concurrency, seconds)
        servers.append({"instances": instances, "threads": threads, "max_batch_size": max_batch,
                        "concurrency": concurrency, **res})  # fmt: skip
    after = engine_at(path, rows, batch, spinning, 3.0)
    engine = (before + after) / 2
    best_server = max(servers, key=lambda s: s["ok_rps"])
    return {"model": name, "note": note, "engine_rps": engine, "engine_before": before,
            "engine_after": after, "engine_batch": batch, "engine_spinning": spinning,
            "servers": servers, "ratio": best_server["ok_rps"] / engine}  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | in-process best (rows/s, batch) | server config | concurrency | server ok req/s "
        "| server p50 / p99 | ratio server / engine |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for s in r["servers"]:
            lines.append(
                f"| {r['model']} | {r['engine_rps']:.1f} (b={r['engine_batch']}, before "
                f"{r['engine_before']:.1f} / after {r['engine_after']:.1f}) | "
                f"{s['instances']} inst x {s['threads']} thr, max batch {s['max_batch_size']} | "
                f"{s['concurrency']} | {s['ok_rps']:.1f} | {_ms(s['p50_ms'])} / {_ms(s['p99_ms'])}"
                f" | **{s['ok_rps'] / r['engine_rps']:.2f}x** |"
            )
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--models", default="mnist,minilm")
    args = ap.parse_args()
    results = [measure(m, args.seconds) for m in args.models.split(",")]
    save_json("throughput", {"results": results})
    notes = "; ".join(f"{r['model']}: {r['note']}" for r in results)
    md = (
        "## Throughput under concurrency: dynamic batching vs the in-process engine\n\n"
        f"Closed loop, single-row binary requests, {args.seconds:g} s after 1 s warm-up; the "
        "engine reference is the best rows/s of `session.run` over batch sizes "
        f"{list(BATCHES)} and spinning on/off, 2 threads, averaged before/after. The load "
        f"generator shares the 2 cores with the server. Models: {notes}.\n\n"
        f"{table(results)}\n\n"
        "Reproduce: `nice -n 10 .venv/bin/python bench/serve_throughput.py`"
    )
    write_section("throughput", md)
    print(md)


if __name__ == "__main__":
    main()
