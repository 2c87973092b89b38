"""Coordinated omission: one 1 s stall, measured open loop and naively closed loop.

The stub v2 server serves one request at a time in 5 ms (a single-worker model server) and stalls
once for 1 s. The open-loop generator keeps sending at 50 requests/s during the stall, so the
~50 requests scheduled in that second wait for it and the p99 shows it. A naive closed-loop
client (one user, next request when the last returns) sends nothing while it waits: one slow
sample among hundreds, p99 unchanged, only max betrays the stall. The same run without a stall
gives the baseline.

    nice -n 10 .venv/bin/python bench/loadtest_coordinated_omission.py \
        --out bench/out/loadtest/coordinated_omission.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench_out import publish, reproduce_command, reproduce_footer
from slimline.loadtest.payload import build_payloads
from slimline.loadtest.run import LoadTestConfig, run_loadtest
from slimline.loadtest.stubserver import stub_server

PAYLOADS = build_payloads({"x": np.random.default_rng(0).random((32, 4), dtype=np.float32)}, "json")
KEYS = ("p50", "p95", "p99", "p999", "max")


def measure(mode: str, stall: bool, duration: float) -> dict[str, Any]:
    # the stall hits the request sent ~40% into the measured window (after a 0.5 s warm-up)
    after = int((0.5 + 0.4 * duration) * (50 if mode == "open" else 180))
    flags = ["--delay-ms", "5", "--serial"]
    if stall:
        flags += ["--stall-ms", "1000", "--stall-after", str(after)]
    with stub_server(*flags) as url:
        shape = {"rate": 50.0, "arrival": "constant"} if mode == "open" else {"concurrency": 1}
        cfg = LoadTestConfig(
            url=url,
            model="stub",
            duration_s=duration,
            warmup_s=0.5,
            processes=1,
            max_lag_ms=1000,
            **shape,
        )
        res = run_loadtest(cfg, payloads=PAYLOADS)
    return {
        "mode": mode,
        "stall": stall,
        "requests": res["requests"],
        "achieved_rate": res["achieved_rate"],
        **{k: res["latency_ms"][k] for k in KEYS},
    }


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    lines = [
        f"Coordinated omission: one 1 s stall, {doc['duration_s']:g} s per run, open vs closed "
        "loop.",
        "",
        "| loop | stall | requests | achieved rps | p50 ms | p95 ms | p99 ms | p99.9 ms | max ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        cells = " | ".join(f"{r[k]:.1f}" for k in KEYS)
        lines.append(
            f"| {r['mode']} | {'1 s once' if r['stall'] else 'none'} | {r['requests']} | "
            f"{r['achieved_rate']:.1f} | {cells} |"
        )
    return "\n".join([*lines, *reproduce_footer(doc["command"])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("bench/out/loadtest/coordinated_omission.md"),
        help="markdown (and .json beside it)",
    )
    args = ap.parse_args(argv)
    rows = [
        measure(mode, stall, args.duration)
        for mode in ("open", "closed")
        for stall in (False, True)
    ]
    cmd = "nice -n 10 " + reproduce_command("loadtest_coordinated_omission.py", argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": cmd, "duration_s": args.duration, "rows": rows}
    publish(render(doc), doc, args.out, "loadtest_coordinated_omission.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
