"""Overload: 10x the server's capacity offered for 30 s, open loop (Poisson arrivals).

1. capacity: closed-loop maximum of ok req/s (single-row binary requests);
2. overload: 10x that rate for ``--seconds``; latency counted from each scheduled time;
3. recovery: from the moment the load stops, time until ``/v2/health/ready`` is 200 and a fresh
   inference request succeeds.

Recorded: the server process alive throughout, its RSS before and after (psutil), the share
rejected (503) and timed out (504), p99 of the accepted requests against
``max_queue_delay + service time`` (the compute time of a full batch, from the server's own
histogram), and the recovery time.

    nice -n 10 .venv/bin/python bench/serve_overload.py [--model minilm] [--seconds 30]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

import httpx
import psutil

from serve_common import MODELS, OUT, closed_loop, open_loop, payloads, save_json, write_section
from slimline.serve import run_in_subprocess

MAX_BATCH, DELAY_MS, QUEUE, TIMEOUT_MS = 16, 2.0, 16, 2000


def compute_totals(url: str) -> tuple[float, float]:
    """(seconds, batches) of model compute so far, from the server's histogram."""
    text = httpx.get(url + "/metrics").text
    total = float(re.search(r"slimline_compute_duration_seconds_sum\{[^}]*\} (\S+)", text)[1])  # type: ignore[index]
    count = float(re.search(r"slimline_compute_duration_seconds_count\{[^}]*\} (\S+)", text)[1])  # type: ignore[index]
    return total, count


def mean_ms(before: tuple[float, float], after: tuple[float, float]) -> float:
    return 1e3 * (after[0] - before[0]) / max(after[1] - before[1], 1.0)


def recovery_s(url: str, name: str, body: bytes, headers: dict[str, str]) -> float:
    t0 = time.perf_counter()
    with httpx.Client(timeout=5) as c:
        while True:
            try:
                ready = c.get(url + "/v2/health/ready").status_code == 200
                ok = ready and c.post(f"{url}/v2/models/{name}/infer", content=body,
                                      headers=headers).status_code == 200  # fmt: skip
            except httpx.HTTPError:
                ok = False
            if ok:
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > 30:
                raise RuntimeError("the server did not recover within 30 s")
            time.sleep(0.01)


def run(name: str, seconds: float, factor: float) -> dict[str, Any]:
    path, rows, note = MODELS[name]()
    loads = payloads(rows, "binary")
    flags = ["--threads", "2", "--max-batch-size", str(MAX_BATCH), "--max-queue-delay-ms",
             str(DELAY_MS), "--max-queue-size", str(QUEUE), "--timeout-ms", str(TIMEOUT_MS)]  # fmt: skip
    with run_in_subprocess([path], flags) as (url, proc):
        server = psutil.Process(proc.pid)
        capacity = closed_loop(url, name, loads, 2 * MAX_BATCH, 8.0)
        rss_before = server.memory_info().rss
        at_capacity = compute_totals(url)
        rate = factor * capacity["ok_rps"]
        over = open_loop(url, name, loads, rate, seconds, timeout_s=30)
        overloaded = compute_totals(url)
        recovered = recovery_s(url, name, loads[0].body, loads[0].headers)
        rss_after = server.memory_info().rss
        alive = proc.poll() is None
    total = max(over["requests"], 1)
    o = over["outcomes"]
    return {
        "model": name, "note": note, "capacity": capacity, "rate": rate, "overload": over,
        "rss_before_mb": rss_before / 2**20, "rss_after_mb": rss_after / 2**20,
        "rejected_share": o["rejected"] / total, "timeout_share": o["timeout"] / total,
        "service_ms": mean_ms((0.0, 0.0), at_capacity),
        "service_overload_ms": mean_ms(at_capacity, overloaded), "recovery_s": recovered,
        "alive": alive, "server_errors": o["server_error"] + o["connection"],
    }  # fmt: skip


def report(r: dict[str, Any], seconds: float) -> str:
    o = r["overload"]
    return (
        f"## Overload: {r['rate'] / r['capacity']['ok_rps']:.0f}x capacity for {seconds:g} s "
        f"({r['model']})\n\n"
        f"{r['note']}. Server: 2 threads, max batch {MAX_BATCH}, max_queue_delay {DELAY_MS:g} ms,"
        f" queue {QUEUE} requests, timeout {TIMEOUT_MS} ms. Open loop, Poisson, single-row "
        "binary requests; latency from the scheduled time.\n\n"
        "| measure | value |\n|---|---|\n"
        f"| capacity (closed loop, c={2 * MAX_BATCH}) | {r['capacity']['ok_rps']:.1f} req/s, "
        f"p99 {r['capacity']['p99_ms']:.0f} ms |\n"
        f"| offered (scheduled) | {o['offered_rps']:.1f} req/s, {o['requests']} requests |\n"
        f"| answered ok | {o['ok_rps']:.1f} req/s |\n"
        f"| rejected 503 / timed out 504 | **{100 * r['rejected_share']:.1f}%** / "
        f"{100 * r['timeout_share']:.1f}% |\n"
        f"| 5xx other than 503/504, connection errors | {r['server_errors']} |\n"
        f"| p50 / p99 of accepted | {o['p50_ms']:.0f} / **{o['p99_ms']:.0f} ms** |\n"
        f"| max_queue_delay + service time (batch compute mean) | at capacity "
        f"{DELAY_MS + r['service_ms']:.0f} ms; during the overload **"
        f"{DELAY_MS + r['service_overload_ms']:.0f} ms** |\n"
        f"| p99 of accepted / (max_queue_delay + service during overload) | "
        f"{o['p99_ms'] / (DELAY_MS + r['service_overload_ms']):.2f} |\n"
        f"| RSS before / after | {r['rss_before_mb']:.0f} / {r['rss_after_mb']:.0f} MiB |\n"
        f"| server alive after | {r['alive']} |\n"
        f"| healthy again after load stops | **{1e3 * r['recovery_s']:.0f} ms** |\n\n"
        "An accepted request finds at most a running batch and one full batch of queued "
        f"requests ahead of it (queue {QUEUE} = max batch {MAX_BATCH}), so its latency is "
        "bounded by about max_queue_delay + 2-3 service times; everything beyond capacity is "
        "turned away at once (503 before the body is decoded). The p99 also carries the spread "
        "of batch times and the lag of the load generator, which shares the 2 cores (latency "
        "counts from the scheduled send time).\n\n"
        "Reproduce: `nice -n 10 .venv/bin/python bench/serve_overload.py`"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--factor", type=float, default=10.0)
    ap.add_argument("--report-only", action="store_true", help="rewrite the table from the JSON")
    args = ap.parse_args()
    if args.report_only:
        r = json.loads((OUT / "overload.json").read_text())
    else:
        r = run(args.model, args.seconds, args.factor)
        save_json("overload", r)
    md = report(r, args.seconds)
    write_section("overload", md)
    print(md)


if __name__ == "__main__":
    main()
