"""gRPC against HTTP binary on one server: p99 and achieved rate per offered rate, interleaved.

One ``slimline serve`` child serves the mnist example's model over HTTP and gRPC (``--grpc-port``)
with one batcher. For each offered rate (Poisson, open loop, latency from the scheduled time) the
load generator sends HTTP binary-tensor requests, then the same rows as gRPC ``ModelInfer`` with
``raw_input_contents``, then again HTTP, then gRPC (A B A B), and keeps each protocol's median
p99 per rate. The knee is the highest rate whose p99 stays within the SLO (50 ms) with under
1% of requests failing. The generator shares the machine's cores with the server.

    nice -n 10 .venv/bin/python bench/serve_grpc.py [--seconds 4] [--rates 100,200,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from typing import Any

import numpy as np
import psutil

from serve_common import OUT, mnist_model, payloads, save_json, summarize, write_section
from slimline.loadtest.client import HttpClient
from slimline.loadtest.generator import ClosedPlan, OpenPlan, execute
from slimline.loadtest.grpc_client import GrpcClient, grpc_payloads
from slimline.serve import run_in_subprocess

SLO_MS = 50.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    protocol: str, target: str, loads: list[Any], rate: float, seconds: float
) -> dict[str, Any]:
    rng = np.random.default_rng(int(rate))
    offsets = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * seconds * 1.3)))
    offsets = offsets[offsets < seconds + 1.0]  # one second of warm-up first
    plan = OpenPlan(offsets, np.arange(len(offsets)) % len(loads))
    if protocol == "grpc":
        rec = execute(lambda: GrpcClient(target, timeout_s=30), plan, loads, connections=1)
    else:
        rec = execute(lambda: HttpClient(target, "mnist", timeout_s=30), plan, loads,
                      connections=64)  # fmt: skip
    out = summarize(rec, 1.0, seconds + 1.0)
    out["offered_rps"] = rate
    return out


async def _sequential(client: Any, loads: list[Any], n: int = 300) -> float:
    """Median ms of ``n`` requests sent one after another (no queueing, no batching)."""
    await client.connect(1)
    took = []
    for i in range(n):
        t = time.perf_counter()
        outcome = await client.infer(loads[i % len(loads)])
        took.append(time.perf_counter() - t)
        assert outcome == "ok", outcome
    await client.aclose()
    return statistics.median(took) * 1e3


def _closed(proto: str, target: str, loads: list[Any], proc: Any) -> dict[str, float]:
    """Closed loop, 8 users, 5 s: achieved req/s and the server's CPU seconds per request
    (user + system of its process: event loop, pools and ONNX Runtime threads)."""
    server = psutil.Process(proc.pid)
    cpu0 = sum(server.cpu_times()[:2])
    if proto == "grpc":
        rec = execute(lambda: GrpcClient(target, timeout_s=30), ClosedPlan(8, 5.0), loads,
                      connections=1)  # fmt: skip
    else:
        rec = execute(lambda: HttpClient(target, "mnist", timeout_s=30), ClosedPlan(8, 5.0),
                      loads, connections=8)  # fmt: skip
    ok = int((rec.outcome == 0).sum())
    cpu = sum(server.cpu_times()[:2]) - cpu0
    return {"rps": ok / 5.0, "cpu_ms": 1e3 * cpu / max(ok, 1)}


def _knee(rows: list[dict[str, Any]]) -> float | None:
    """The highest offered rate below which every step passed (the first failure ends it)."""
    knee = None
    for r in sorted(rows, key=lambda r: r["offered_rps"]):
        if not _passes(r):
            break
        knee = r["offered_rps"]
    return knee


def _passes(r: dict[str, Any]) -> bool:
    failed = r["requests"] - r["outcomes"]["ok"]
    return r["p99_ms"] is not None and r["p99_ms"] <= SLO_MS and failed <= 0.01 * r["requests"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rates", default="40,60,80,100,120,160")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--render-only", action="store_true", help="rewrite the section from JSON")
    args = ap.parse_args()
    if args.render_only:
        doc = json.loads((OUT / "grpc.json").read_text())
        render(doc["results"], doc["note"], doc.get("seconds", args.seconds),
               doc.get("rounds", args.rounds), doc.get("sequential_ms"))  # fmt: skip
        return
    path, rows, note = mnist_model()
    http_loads = payloads(rows, "binary")
    grpc_loads = grpc_payloads(rows, "mnist", 1)[:32]
    port = _free_port()
    flags = ["--grpc-port", str(port), "--threads", "1", "--max-batch-size", "16",
             "--max-queue-delay-ms", "2"]  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {"http": [], "grpc": []}
    sequential: dict[str, list[float]] = {"http": [], "grpc": []}
    closed: dict[str, list[dict[str, float]]] = {"http": [], "grpc": []}
    with run_in_subprocess([path], flags) as (url, proc):
        for _ in range(2):  # closed loop, alternating: server CPU per request
            closed["http"].append(_closed("http", url, http_loads, proc))
            closed["grpc"].append(_closed("grpc", f"127.0.0.1:{port}", grpc_loads, proc))
        for _ in range(3):  # one request at a time, alternating: the protocols' own latency
            client = HttpClient(url, "mnist", timeout_s=30)
            sequential["http"].append(asyncio.run(_sequential(client, http_loads)))
            grpc_client = GrpcClient(f"127.0.0.1:{port}", timeout_s=30)
            sequential["grpc"].append(asyncio.run(_sequential(grpc_client, grpc_loads)))
        for rate in [float(r) for r in args.rates.split(",")]:
            runs: dict[str, list[dict[str, Any]]] = {"http": [], "grpc": []}
            for _ in range(args.rounds):
                runs["http"].append(_run("http", url, http_loads, rate, args.seconds))
                runs["grpc"].append(
                    _run("grpc", f"127.0.0.1:{port}", grpc_loads, rate, args.seconds)
                )
            for proto, got in runs.items():
                merged = dict(got[-1])
                merged["p99_ms"] = statistics.median(g["p99_ms"] or float("inf") for g in got)
                merged["p50_ms"] = statistics.median(g["p50_ms"] or float("inf") for g in got)
                merged["ok_rps"] = statistics.median(g["ok_rps"] for g in got)
                results[proto].append(merged)
            print(rate, {p: round(results[p][-1]["p99_ms"], 1) for p in results}, flush=True)
    seq = {p: statistics.median(v) for p, v in sequential.items()}
    for p, v in closed.items():
        seq[f"{p}_cpu_ms"] = statistics.median(x["cpu_ms"] for x in v)
        seq[f"{p}_closed_rps"] = statistics.median(x["rps"] for x in v)
    save_json("grpc", {"note": note, "results": results, "slo_ms": SLO_MS, "sequential_ms": seq,
                       "seconds": args.seconds, "rounds": args.rounds})  # fmt: skip
    render(results, note, args.seconds, args.rounds, seq)


def render(
    results: dict[str, list[dict[str, Any]]],
    note: str,
    seconds: float,
    rounds: int,
    seq: dict[str, float] | None = None,
) -> None:
    """Write the section of bench/RESULTS-serve.md from measured ``results``."""
    knees = {p: _knee(r) for p, r in results.items()}
    lines = [
        "## gRPC against HTTP binary (one server, one batcher)",
        "",
        f"mnist example model ({note}), FP32 ONNX, `--threads 1 --max-batch-size 16 "
        f"--max-queue-delay-ms 2`; one-row requests, Poisson open loop, {seconds:g} s per "
        f"step after 1 s of warm-up, {rounds} interleaved rounds (HTTP, gRPC, HTTP, gRPC), "
        "medians.",
        "",
        "| offered req/s | HTTP binary p50 / p99 ms | gRPC p50 / p99 ms | HTTP ok/s | gRPC ok/s |",
        "|---|---|---|---|---|",
    ]
    for h, g in zip(results["http"], results["grpc"], strict=True):
        lines.append(f"| {h['offered_rps']:.0f} | {h['p50_ms']:.1f} / {h['p99_ms']:.1f} | "
                     f"{g['p50_ms']:.1f} / {g['p99_ms']:.1f} | {h['ok_rps']:.0f} | "
                     f"{g['ok_rps']:.0f} |")  # fmt: skip
    ratio = (knees["grpc"] / knees["http"]) if knees["grpc"] and knees["http"] else None
    lowest = min(r["offered_rps"] for r in results["http"])
    shown = {p: f"{k:g} req/s" if k else f"below {lowest:g} req/s" for p, k in knees.items()}
    lines += ["", f"Knee (every step up to it: p99 <= {SLO_MS:g} ms, <1% failed): HTTP binary "
              f"{shown['http']}, gRPC {shown['grpc']}" + (f" ({ratio:.2f}x)." if ratio else ".")]  # fmt: skip
    if seq:
        lines += ["", f"One request at a time (300 each, 3 alternating rounds, median): HTTP "
                  f"binary {seq['http']:.2f} ms, gRPC {seq['grpc']:.2f} ms."]  # fmt: skip
    if seq and "http_cpu_ms" in seq:
        lines += ["", f"Closed loop, 8 users, 5 s (2 alternating rounds, median): HTTP binary "
                  f"{seq['http_closed_rps']:.0f} req/s at {seq['http_cpu_ms']:.2f} ms of server "
                  f"CPU per request, gRPC {seq['grpc_closed_rps']:.0f} req/s at "
                  f"{seq['grpc_cpu_ms']:.2f} ms."]  # fmt: skip
    lines += ["", "On a machine whose 2 cores other work also used (below), the p99 of both "
              "protocols moves by tens of ms from step to step; compare the columns, not the "
              "absolute numbers.", "",
              "Reproduce: `nice -n 10 .venv/bin/python bench/serve_grpc.py` (`--render-only` "
              "rewrites this section from bench/out/serve/grpc.json)"]  # fmt: skip
    write_section("grpc", "\n".join(lines))


if __name__ == "__main__":
    main()
