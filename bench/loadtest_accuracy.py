"""Load generator accuracy against a server with a known delay, and the highest rate one process keeps.

The stub v2 server (``slimline.loadtest.stubserver``) answers every request after exactly
``--delay-ms`` (each request on its own thread: no queue). The truth is what the simplest client
measures on the same server at the same time: one blocking ``http.client`` request after another,
in its own process. For each offered rate the open-loop generator (one process, Poisson arrivals)
runs ``--repeats`` times; the table gives medians over repeats of

* p50 and p99 error: generator percentile minus the reference's (ms);
* achieved / offered rate;
* schedule lag p50 / p99 (how late requests left).

The highest sustained rate is the highest offered rate whose achieved rate is within 2% of
offered, whose p50 is within 1 ms of the truth, and whose lag p99 stays under the 10 ms limit
that invalidates a run. A second table compares the client cost of the lean
HTTP client with aiohttp's (sequential round trips against the same server, median of medians).

    nice -n 10 .venv/bin/python bench/loadtest_accuracy.py --rates 50,100,200,500,1000,2000 \
        --repeats 3 --out bench/out/loadtest/accuracy.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench_out import publish, reproduce_command, reproduce_footer
from slimline.loadtest.client import HttpClient
from slimline.loadtest.payload import build_payloads
from slimline.loadtest.run import LoadTestConfig, run_loadtest
from slimline.loadtest.stubserver import stub_server

PAYLOADS = build_payloads({"x": np.random.default_rng(0).random((32, 4), dtype=np.float32)}, "json")

_REFERENCE = """
import http.client, json, socket, sys, time
host, port, path, body, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
conn = http.client.HTTPConnection(host, port)
conn.connect()
conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
out, end = [], time.monotonic() + seconds
while time.monotonic() < end:
    t = time.monotonic()
    conn.request("POST", path, body=body.encode(), headers={"Content-Type": "application/json"})
    conn.getresponse().read()
    out.append((time.monotonic() - t) * 1e3)
print(json.dumps(out))
"""


def reference(url: str, seconds: float) -> subprocess.Popen[str]:
    host, port = url.removeprefix("http://").split(":")
    args = [host, port, "/v2/models/stub/infer", PAYLOADS[0].body.decode(), str(seconds)]
    return subprocess.Popen(
        [sys.executable, "-c", _REFERENCE, *args], stdout=subprocess.PIPE, text=True
    )


def one_run(url: str, rate: float, duration: float, seed: int) -> dict[str, float]:
    ref = reference(url, duration + 1.0)
    cfg = LoadTestConfig(
        url=url,
        model="stub",
        rate=rate,
        duration_s=duration,
        warmup_s=1.0,
        seed=seed,
        processes=1,
        max_lag_ms=1000,
    )
    res = run_loadtest(cfg, payloads=PAYLOADS)
    truth = np.array(json.loads(ref.communicate(timeout=60)[0]))
    lat, lag = res["latency_ms"], res["schedule_lag_ms"]
    return {
        "p50_err_ms": lat["p50"] - float(np.percentile(truth, 50)),
        "p99_err_ms": lat["p99"] - float(np.percentile(truth, 99)),
        "achieved_over_offered": res["achieved_rate"] / res["offered_rate"],
        "lag_p50_ms": lag["p50"],
        "lag_p99_ms": lag["p99"],
        "errors": res["error_rate"],
        "requests": res["requests"],
    }


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


async def _client_cost(url: str, n: int, which: str) -> float:
    """Median sequential round trip (ms) with the lean client or aiohttp."""
    times = []
    if which == "lean":
        client = HttpClient(url, "stub")
        await client.connect(1)
        for _ in range(n):
            t = time.monotonic()
            await client.infer(PAYLOADS[0])
            times.append(time.monotonic() - t)
        await client.aclose()
    else:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            for _ in range(n):
                t = time.monotonic()
                async with session.post(
                    f"{url}/v2/models/stub/infer",
                    data=PAYLOADS[0].body,
                    headers=PAYLOADS[0].headers,
                ) as resp:
                    await resp.read()
                times.append(time.monotonic() - t)
    return statistics.median(times) * 1e3


def client_costs(url: str, rounds: int) -> dict[str, float]:
    import uvloop

    out: dict[str, list[float]] = {"lean": [], "aiohttp": []}
    for _ in range(rounds):  # interleaved: lean, aiohttp, lean, aiohttp, ...
        for which in out:
            out[which].append(uvloop.run(_client_cost(url, 200, which)))
    return {k: statistics.median(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="50,100,200,500,1000,2000")
    ap.add_argument("--delay-ms", type=float, default=10.0)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("bench/out/loadtest/accuracy.md"),
        help="markdown (and .json beside it)",
    )
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with stub_server("--delay-ms", str(args.delay_ms)) as url:
        costs = client_costs(url, 5)
        for rate in [float(r) for r in args.rates.split(",")]:
            runs = [one_run(url, rate, args.duration, seed) for seed in range(args.repeats)]
            row = {"rate": rate, **medians(runs)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    sustained = [
        r["rate"] for r in rows
        if r["lag_p99_ms"] < 10.0 and abs(r["p50_err_ms"]) <= 1.0
        and abs(r["achieved_over_offered"] - 1) <= 0.02
    ]  # fmt: skip
    doc = {
        "delay_ms": args.delay_ms,
        "duration_s": args.duration,
        "repeats": args.repeats,
        "rows": rows,
        "highest_sustained_rate": max(sustained) if sustained else None,
        "client_round_trip_ms": costs,
    }
    doc["command"] = "nice -n 10 " + reproduce_command("loadtest_accuracy.py", argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    publish(render(doc), doc, args.out, "loadtest_accuracy.py")
    return 0


def table(doc: dict[str, Any]) -> str:
    lines = [
        "| offered rps | p50 err ms | p99 err ms | achieved/offered | lag p50 ms | lag p99 ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['rate']:.0f} | {r['p50_err_ms']:+.3f} | {r['p99_err_ms']:+.3f} | "
            f"{r['achieved_over_offered']:.4f} | {r['lag_p50_ms']:.3f} | {r['lag_p99_ms']:.3f} |"
        )
    c = doc["client_round_trip_ms"]
    lines.append("")
    lines.append(
        "highest rate one process sustains (achieved within 2%, p50 within 1 ms, lag p99 < 10 ms): "
        f"{doc['highest_sustained_rate'] or 'none of the offered rates'}"
    )
    lines.append(
        f"sequential round trip, {doc['delay_ms']:g} ms server: lean client {c['lean']:.3f} ms, "
        f"aiohttp {c['aiohttp']:.3f} ms (ratio {c['aiohttp'] / c['lean']:.3f})"
    )
    return "\n".join(lines)


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    return "\n".join([table(doc), *reproduce_footer(doc["command"])])


if __name__ == "__main__":
    sys.exit(main())
