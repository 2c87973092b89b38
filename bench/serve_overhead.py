"""Serving overhead at low load: server p50 minus in-process ONNX Runtime p50, batch 1.

One request at a time, interleaved A B C A B C ... so machine noise hits every column alike:
A = ``session.run`` in this process, B = the same row through the server with binary tensors,
C = the same row as JSON. Server and in-process session both use 2 intra-op threads; the
server runs in a child process (``slimline.serve.run_in_subprocess``). The client is the
standard library's keep-alive ``http.client``; its own time is part of the server column.

    nice -n 10 .venv/bin/python bench/serve_overhead.py [--rounds 300]
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from serve_common import MODELS, median_ms, payloads, save_json, write_section
from slimline.serve import run_in_subprocess
from slimline.serve.model import ort_serving_session

THREADS = 2


def post(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict[str, str]) -> None:
    conn.request("POST", path, body, headers)
    resp = conn.getresponse()
    resp.read()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}")


def measure(name: str, delay_ms: float, rounds: int) -> dict[str, Any]:
    path, rows, note = MODELS[name]()
    sess = ort_serving_session(path, THREADS)  # the server's own session options
    binary, as_json = payloads(rows, "binary"), payloads(rows, "json")
    flags = ["--threads", str(THREADS), "--max-batch-size", "8",
             "--max-queue-delay-ms", str(delay_ms)]  # fmt: skip
    times: dict[str, list[float]] = {"ort": [], "binary": [], "json": []}
    with run_in_subprocess([path], flags) as (url, _):
        u = urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port)
        route = f"/v2/models/{name}/infer"
        for i in range(rounds + 20):
            j = i % len(binary)
            feed = {k: v[j : j + 1] for k, v in rows.items()}
            t0 = time.perf_counter()
            sess.run(None, feed)
            t1 = time.perf_counter()
            post(conn, route, binary[j].body, binary[j].headers)
            t2 = time.perf_counter()
            post(conn, route, as_json[j].body, as_json[j].headers)
            t3 = time.perf_counter()
            if i >= 20:  # warm-up rounds
                times["ort"].append(t1 - t0)
                times["binary"].append(t2 - t1)
                times["json"].append(t3 - t2)
        conn.close()
        inside = server_view(url)
    p50 = {k: median_ms(v) for k, v in times.items()}
    p99 = {k: float(np.percentile(v, 99) * 1e3) for k, v in times.items()}
    return {"model": name, "note": note, "delay_ms": delay_ms, "rounds": rounds,
            "p50_ms": p50, "p99_ms": p99, "server_view_ms": inside,
            "load_avg": os.getloadavg()[0]}  # fmt: skip


def server_view(url: str) -> dict[str, float]:
    """Mean end-to-end, queue and compute time per request as the server itself measured
    them (its Prometheus histograms): what the server adds, without the client or network."""
    text = httpx.get(url + "/metrics").text

    def mean(metric: str) -> float:
        total = float(re.search(metric + r"_sum\{[^}]*\} (\S+)", text)[1])  # type: ignore[index]
        count = float(re.search(metric + r"_count\{[^}]*\} (\S+)", text)[1])  # type: ignore[index]
        return 1e3 * total / max(count, 1.0)

    e2e = mean("slimline_request_duration_seconds")
    compute = mean("slimline_compute_duration_seconds")
    return {"e2e": e2e, "queue": mean("slimline_queue_duration_seconds"), "compute": compute,
            "added": e2e - compute}  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | max_queue_delay_ms | ORT in-process p50 | server p50 (binary) | server p50 (JSON) "
        "| overhead binary | overhead JSON | inside the server: e2e - compute (mean) | load avg |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, v = r["p50_ms"], r["server_view_ms"]
        lines.append(
            f"| {r['model']} | {r['delay_ms']:g} | {p['ort']:.3f} ms | {p['binary']:.3f} ms | "
            f"{p['json']:.3f} ms | **{p['binary'] - p['ort']:+.3f} ms** | "
            f"{p['json'] - p['ort']:+.3f} ms | {v['added']:.3f} ms (queue {v['queue']:.3f}) | "
            f"{r['load_avg']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    results = [measure(m, d, args.rounds) for m in ("mnist", "minilm") for d in (0.0, 2.0)]
    save_json("overhead", {"results": results})
    notes = "; ".join(sorted({f"{r['model']}: {r['note']}" for r in results}))
    md = (
        "## Overhead at low load (batch 1, one request at a time)\n\n"
        f"Interleaved A/B/C, {args.rounds} rounds per row, medians; {THREADS} intra-op threads "
        f"in both. Models: {notes}. With the default `--max-queue-delay-ms 2` a lone request "
        "waits for company by design; `0` shows the pure protocol + HTTP + batcher cost. "
        "The machine is shared (load average in the last column, 2 cores): a server request "
        "needs three processes' threads scheduled in turn (client, event loop, ORT workers), so "
        "CPU contention inflates the client-side overhead; the server's own histograms give "
        "what it adds between receiving a request and sending its answer.\n\n"
        f"{table(results)}\n\n"
        "Reproduce: `nice -n 10 .venv/bin/python bench/serve_overhead.py`"
    )
    write_section("overhead", md)
    print(md)


if __name__ == "__main__":
    main()
