"""gRPC against HTTP binary on one server: the knee of each, interleaved (issue 28's first target).

One ``slimline serve`` child serves the INT8 mnist model over HTTP and gRPC (``--grpc-port``)
with one batcher. For each offered rate (Poisson, open loop, latency from the scheduled time)
the load generator sends, in rotating order within each round, one-row HTTP binary-tensor
requests, the same rows as gRPC ``ModelInfer`` calls with ``raw_input_contents``, and as
requests on one gRPC ``ModelStreamInfer`` stream (Triton's streaming infer). Per rate and
protocol the median p99 over the rounds decides: the knee is the highest rate that, with every
rate below it, keeps the median p99 within the SLO (50 ms) with under 1% of requests failing. A
protocol that failed a step has its knee and is not sent the higher rates.

Before the sweep, a closed loop (8 users, alternating) gives each protocol's CPU per request:
the server process's and the load generator's (this process), which share the 2 cores.

Run by ``bench/serve_platform.py`` (``--only grpc``); measurement only, no results file.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any

import numpy as np
import psutil

from serve_common import payloads, summarize
from slimline.loadtest.client import HttpClient
from slimline.loadtest.generator import ClosedPlan, OpenPlan, execute
from slimline.loadtest.grpc_client import GrpcClient, grpc_payloads
from slimline.serve import run_in_subprocess

SLO_MS = 50.0
FLAGS = ["--threads", "2", "--max-batch-size", "16", "--max-queue-delay-ms", "2"]
PROTOCOLS = ("http", "grpc", "grpc-stream")
NAMES = {"http": "HTTP binary", "grpc": "gRPC ModelInfer", "grpc-stream": "gRPC ModelStreamInfer"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _client(proto: str, url: str, target: str) -> Any:
    if proto == "http":
        return HttpClient(url, "mnist", timeout_s=30)
    return GrpcClient(target, timeout_s=30, stream=proto == "grpc-stream")


def _open(proto: str, ends: tuple[str, str], loads: list[Any], rate: float,
          seconds: float, seed: int) -> dict[str, Any]:  # fmt: skip
    rng = np.random.default_rng(seed)
    offsets = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * (seconds + 1) * 1.3) + 10))
    offsets = offsets[offsets < seconds + 1.0]  # one second of warm-up first
    plan = OpenPlan(offsets, np.arange(len(offsets)) % len(loads))
    rec = execute(lambda: _client(proto, *ends), plan, loads,
                  connections=64 if proto == "http" else 1)  # fmt: skip
    out = summarize(rec, 1.0, seconds + 1.0)
    out["offered_rps"] = rate
    return out


def _closed(proto: str, ends: tuple[str, str], loads: list[Any], server: psutil.Process,
            seconds: float = 4.0) -> dict[str, float]:  # fmt: skip
    """Closed loop, 8 users: req/s, and CPU µs per request of the server and of the generator."""
    cpu0, gen0 = sum(server.cpu_times()[:2]), time.process_time()
    rec = execute(lambda: _client(proto, *ends), ClosedPlan(8, seconds), loads,
                  connections=8 if proto == "http" else 1)  # fmt: skip
    ok = max(int((rec.outcome == 0).sum()), 1)
    server_us = 1e6 * (sum(server.cpu_times()[:2]) - cpu0) / ok
    return {"rps": ok / seconds, "server_us": server_us,
            "client_us": 1e6 * (time.process_time() - gen0) / ok}  # fmt: skip


def knee(rows: list[dict[str, Any]]) -> float | None:
    """The highest offered rate below which every step passed (the first failure ends it)."""
    best = None
    for r in sorted(rows, key=lambda r: r["offered_rps"]):
        if not passes(r):
            break
        best = r["offered_rps"]
    return best


def shown_knee(rows: list[dict[str, Any]]) -> str:
    """The knee as text: ">= top" when every step passed (the sweep did not reach it)."""
    k = knee(rows)
    if k is None:
        return f"below {min(r['offered_rps'] for r in rows):g}"
    return f">= {k:g}" if k == max(r["offered_rps"] for r in rows) else f"{k:g}"


def passes(r: dict[str, Any]) -> bool:
    failed = r["requests"] - r["outcomes"]["ok"]
    return r["p99_ms"] is not None and r["p99_ms"] <= SLO_MS and failed <= 0.01 * r["requests"]


def merge_rounds(got: list[dict[str, Any]]) -> dict[str, Any]:
    """One step from its rounds: median p50/p99/ok rate, failures and requests summed."""
    merged = {"offered_rps": got[0]["offered_rps"], "rounds_p99_ms": [g["p99_ms"] for g in got]}
    for key in ("p50_ms", "p99_ms"):
        merged[key] = statistics.median(g[key] if g[key] is not None else 1e9 for g in got)
    merged["ok_rps"] = statistics.median(g["ok_rps"] for g in got)
    merged["requests"] = sum(g["requests"] for g in got)
    merged["outcomes"] = {"ok": sum(g["outcomes"]["ok"] for g in got)}
    return merged


def measure(path: Any, rows: dict[str, np.ndarray], rates: list[float], rounds: int,
            seconds: float) -> dict[str, Any]:  # fmt: skip
    loads = {"http": payloads(rows, "binary"), "grpc": grpc_payloads(rows, "mnist", 1)[:32]}
    loads["grpc-stream"] = loads["grpc"]
    port = free_port()
    closed: dict[str, list[dict[str, float]]] = {p: [] for p in PROTOCOLS}
    steps: dict[str, list[dict[str, Any]]] = {p: [] for p in PROTOCOLS}
    with run_in_subprocess([path], ["--grpc-port", str(port), *FLAGS]) as (url, proc):
        ends = (url, f"127.0.0.1:{port}")
        server = psutil.Process(proc.pid)
        for r in range(2):
            for proto in PROTOCOLS[r % 3 :] + PROTOCOLS[: r % 3]:
                closed[proto].append(_closed(proto, ends, loads[proto], server))
        for rate in rates:
            going = [p for p in PROTOCOLS if not steps[p] or passes(steps[p][-1])]
            if not going:  # every protocol has its knee: no higher rate to send
                break
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in going}
            for r in range(rounds):  # the order rotates, so no contender always goes first
                for proto in going[r % len(going) :] + going[: r % len(going)]:
                    runs[proto].append(_open(proto, ends, loads[proto], rate, seconds, r))
            for proto, got in runs.items():
                steps[proto].append(merge_rounds(got))
            print(rate, {p: round(steps[p][-1]["p99_ms"], 1) for p in going}, flush=True)
    cpu = {p: {k: statistics.median(c[k] for c in v) for k in v[0]} for p, v in closed.items()}
    return {"flags": FLAGS, "slo_ms": SLO_MS, "rounds": rounds, "seconds": seconds,
            "steps": steps, "knees": {p: knee(s) for p, s in steps.items()},
            "closed_loop": cpu}  # fmt: skip


def step_rows(steps: dict[str, list[dict[str, Any]]], names: tuple[str, ...]) -> list[str]:
    """One table row per offered rate: each contender's median p50 / p99, "-" once it stopped."""
    rates = sorted({s["offered_rps"] for v in steps.values() for s in v})
    rows = []
    for rate in rates:
        found = {n: next((s for s in steps[n] if s["offered_rps"] == rate), None) for n in names}
        cells = [f"{s['p50_ms']:.1f} / {s['p99_ms']:.1f}" if s else "-" for s in found.values()]
        rows.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    return rows


def render(part: dict[str, Any]) -> list[str]:
    """The part's section: per-rate table, knees, CPU per request."""
    steps = part["steps"]
    lines = [
        f"One `slimline serve` ({part['model']}; `{' '.join(part['flags'])}`), one batcher, "
        "three protocols in rotating order per round; one-row requests, Poisson open loop, "
        f"{part['seconds']:g} s per step after 1 s of warm-up, {part['rounds']} rounds, median "
        "p50 / p99 per step.",
        "",
        "| offered req/s | " + " | ".join(f"{NAMES[p]} p50 / p99 ms" for p in PROTOCOLS) + " |",
        "|---|" + "---|" * len(PROTOCOLS),
    ]
    lines += step_rows(steps, PROTOCOLS)
    shown = {p: f"{shown_knee(steps[p])} req/s" for p in PROTOCOLS}
    lines += ["", f"Knee (it and every step below: median p99 <= {part['slo_ms']:g} ms, <1% "
              "failed): " + ", ".join(f"{NAMES[p]} **{shown[p]}**" for p in PROTOCOLS) + "."]  # fmt: skip
    cpu = part["closed_loop"]
    lines += ["", "CPU per request, closed loop of 8 users (2 rounds, medians; server process / "
              "load generator, µs): " + "; ".join(
                  f"{NAMES[p]} {cpu[p]['server_us']:.0f} / {cpu[p]['client_us']:.0f} at "
                  f"{cpu[p]['rps']:.0f} req/s" for p in PROTOCOLS) + "."]  # fmt: skip
    return lines
