"""Issue 28's measured targets, each side by side in one run: gRPC against HTTP binary at the
knee, a rollout under open-loop load, and low load and the knee against MLServer.

    flock /tmp/slimline-timing.lock .venv/bin/python bench/serve_platform.py \\
        --mlserver /tmp/mlserver-venv/bin/mlserver [--only grpc|low-load|rollout]

Every part serves the mnist example quantized to INT8 by slimline's own quantize step
(``serve_common.mnist_int8_model``) and runs its contenders in interleaved rounds, so that both
face the same load from the rest of the machine. ``--only`` measures one part again and keeps
the others from ``bench/RESULTS-serve.json``; each part records its own command, time, CPU kind
and the load average before and after it. The section this script owns in
``bench/RESULTS-serve.md`` is ``render`` of that JSON (``--render-only`` rewrites it).
MLServer is installed into its own venv (``bench/serve_mlserver.py`` says how).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import serve_grpc
import serve_low_load
import serve_rollout
from bench_out import publish, reproduce_command
from serve_common import BENCH, mnist_int8_model
from slimline.cpu import detect
from slimline.record import atomic_write_text

RESULTS = BENCH / "RESULTS-serve.md"
PARTS = ("grpc", "rollout", "low-load")
SCRIPT = "serve_platform.py"


def _machine() -> dict[str, Any]:
    from slimline.measure.host import other_work

    work = other_work(1.0)
    return {"load_avg_1m": round(os.getloadavg()[0], 2),
            "other_cores": None if work is None else round(work[0], 2)}  # fmt: skip


def _measure(part: str, args: argparse.Namespace) -> dict[str, Any]:
    path, rows, note = mnist_int8_model()
    before = _machine()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if part == "grpc":
        rates = [float(r) for r in args.rates.split(",")]
        doc = serve_grpc.measure(path, rows, rates, args.rounds, args.step_s)
    elif part == "rollout":
        doc = serve_rollout.measure(path, rows, args.rollout_rate, args.rollout_s)
    else:
        doc = serve_low_load.measure(
            path, rows, Path(args.mlserver), rate=9.0, seconds=args.low_s, rounds=args.rounds,
            rates=[float(r) for r in args.json_rates.split(",")], knee_rounds=args.rounds,
            step_s=args.step_s,
        )  # fmt: skip
    doc.update(model=f"mnist INT8 ({note})", measured_at=started, cpu=detect().describe(),
               cores=os.cpu_count(), machine_before=before, machine_after=_machine(),
               command=reproduce_command(SCRIPT, ["--only", part, *_part_args(part, args)]))  # fmt: skip
    return doc


def _part_args(part: str, args: argparse.Namespace) -> list[str]:
    if part == "grpc":
        return ["--rates", args.rates, "--rounds", str(args.rounds), "--step-s", str(args.step_s)]
    if part == "rollout":
        return ["--rollout-rate", str(args.rollout_rate), "--rollout-s", str(args.rollout_s)]
    return ["--mlserver", args.mlserver, "--json-rates", args.json_rates, "--rounds",
            str(args.rounds), "--step-s", str(args.step_s), "--low-s", str(args.low_s)]  # fmt: skip


def _verdict(ok: bool | None) -> str:
    return "not resolved" if ok is None else ("**met**" if ok else "**not met**")


def _targets(doc: dict[str, Any]) -> list[str]:
    lines = ["| target | required | measured | verdict |", "|---|---|---|---|"]
    g = doc.get("grpc")
    if g:
        k = g["knees"]
        shown = {p: serve_grpc.shown_knee(g["steps"][p]) for p in k}
        top = {p: k[p] == max(s["offered_rps"] for s in g["steps"][p]) for p in k}

        def at_least_http(p: str) -> bool | None:
            if not k["http"] or (top["http"] and top[p]):
                return None  # both passed every step: the sweep reached neither knee
            return bool((k[p] or 0) >= k["http"])

        unary, stream = at_least_http("grpc"), at_least_http("grpc-stream")
        lines.append(f"| gRPC throughput at the knee (p99 <= 50 ms, mnist INT8, 2 cores) | >= "
                     f"HTTP binary's | HTTP binary {shown['http']} req/s; gRPC ModelInfer "
                     f"{shown['grpc']}; gRPC ModelStreamInfer {shown['grpc-stream']} | unary "
                     f"{_verdict(unary)}; stream {_verdict(stream)} |")  # fmt: skip
    r = doc.get("rollout")
    if r:
        ok = r["failed"] == 0 and r["ratio"]["during"] is not None and r["ratio"]["during"] <= 2
        lines.append(f"| rollout: a new version loaded under {r['rate']:g} requests/s of "
                     f"open-loop load | 0 failed; p99 during the swap within 2x steady state | "
                     f"{r['failed']} failed of {r['requests']}; p99 during "
                     f"{r['ratio']['during']:.2f}x steady | {_verdict(ok)} |")  # fmt: skip
    low = doc.get("low-load")
    if low:
        peer, p50 = serve_low_load.best_peer(low["p50_ms"], lower_is_better=True)
        kpeer, kv = serve_low_load.best_peer(low["knees"], lower_is_better=False)
        mine, knee = low["p50_ms"]["slimline"], low["knees"]["slimline"]
        ratio = knee / kv if knee and kv else None
        capped = knee == max(s["offered_rps"] for s in low["steps"]["slimline"])
        ok = None if p50 is None or ratio is None else mine <= p50 and ratio >= 1.4
        if ok is False and capped and mine <= (p50 or 0):
            ok = None  # slimline passed every step: the sweep did not reach its knee
        lines.append(f"| low-load p50 ({low['rate']:g} requests/s, same model, same client) | <= "
                     f"MLServer's, knee >= 1.4x MLServer's | p50 {mine:.2f} ms vs "
                     f"{p50 or 0:.2f} ms ({serve_low_load.NAMES.get(peer, peer)}); knee "
                     f"{serve_grpc.shown_knee(low['steps']['slimline'])} vs "
                     f"{serve_grpc.shown_knee(low['steps'][kpeer]) if kv else 'none'} req/s "
                     f"({serve_low_load.NAMES.get(kpeer, kpeer)}): {ratio or 0:.2f}x | "
                     f"{_verdict(ok)} |")  # fmt: skip
    return lines


TITLES = {
    "grpc": ("gRPC against HTTP binary at the knee", serve_grpc.render),
    "rollout": ("A rollout under load", serve_rollout.render),
    "low-load": ("Low load and the knee against MLServer", serve_low_load.render),
}


def render(doc: dict[str, Any]) -> str:
    lines = ["## Issue 28's measured targets", "", *_targets(doc)]
    for part in PARTS:
        if part not in doc:
            continue
        title, part_render = TITLES[part]
        d = doc[part]
        b, a = d["machine_before"], d["machine_after"]
        lines += ["", f"### {title}", "", *part_render(d), "",
                  f"Reproduce: `flock /tmp/slimline-timing.lock {d['command']}`", "",
                  f"Measured {d['measured_at']} on {d['cpu']}, {d['cores']} cores; load average "
                  f"(1 min) {b['load_avg_1m']:.1f} before, {a['load_avg_1m']:.1f} after; other "
                  f"processes used {b['other_cores']} / {a['other_cores']} cores in the second "
                  "before / after."]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=PARTS, action="append", help="measure only these parts")
    ap.add_argument("--mlserver", default="/tmp/mlserver-venv/bin/mlserver")
    ap.add_argument("--rates", default="150,250,350,450,550", help="gRPC/HTTP sweep, req/s")
    ap.add_argument("--json-rates", default="50,100,150,200,300", help="MLServer sweep, req/s")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-s", type=float, default=3.0)
    ap.add_argument("--low-s", type=float, default=10.0)
    ap.add_argument("--rollout-rate", type=float, default=100.0)
    ap.add_argument("--rollout-s", type=float, default=24.0)
    ap.add_argument("--render-only", action="store_true", help="rewrite the section from JSON")
    args = ap.parse_args()
    stored = RESULTS.with_suffix(".json")
    doc: dict[str, Any] = json.loads(stored.read_text()) if stored.is_file() else {}
    if not args.render_only:
        for part in args.only or PARTS:
            doc[part] = _measure(part, args)
            # kept as soon as it is measured, before anything can fail in rendering it
            atomic_write_text(stored, json.dumps(doc, indent=1, default=str))
            publish(render(doc), doc, RESULTS, "serve_platform.py")
    publish(render(doc), doc, RESULTS, "serve_platform.py")


if __name__ == "__main__":
    main()
