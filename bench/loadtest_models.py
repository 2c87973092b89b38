"""mnist and minilm served by slimline: sweep knees, capacity for a peak, and tune-serving's pick.

For a run directory of ``slimline optimize`` (mnist or minilm), with every figure measured
against a real ``slimline serve`` child process on this machine:

1. the sweep's knee at ``--slo-p99-ms`` for the FP32 ONNX baseline and for the run's selected
   (optimized) candidate, both with the default batcher settings;
2. ``slimline capacity`` for ``--peak-qps`` (5,000) with ``--headroom`` (40%) from each sweep;
3. ``slimline tune-serving`` on the run (a bounded grid), against the default settings.

    .venv/bin/python bench/loadtest_models.py /tmp/runs/mnist --slo-p99-ms 50 \
        --out bench/out/loadtest/mnist.md

The generator and the server share this machine's cores, so the knees are what one such machine
serves while also generating its own load: a lower bound for a dedicated server. Each server runs
at nice 10 (the heavy side) and the light generator at the default priority, so the generator
keeps its schedule on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench_out import figure, publish, reproduce_command, reproduce_footer
from slimline.loadtest.capacity import plan_capacity
from slimline.loadtest.payload import build_payloads, load_samples
from slimline.loadtest.result import write_json
from slimline.loadtest.run import LoadTestConfig
from slimline.loadtest.sweep import SweepConfig, http_step_runner, run_sweep
from slimline.loadtest.tune import ServeSetting, TuneConfig, run_variants, tune_serving
from slimline.serve import run_in_subprocess


@contextmanager
def niced_server(path: Path, serve_args: list[str]) -> Iterator[str]:
    """`slimline serve` in a child at nice 10: the heavy side yields the CPU, the generator keeps time."""
    with run_in_subprocess([path], serve_args) as (url, proc):
        for task in Path(f"/proc/{proc.pid}/task").iterdir():  # every thread: nice is per thread
            os.setpriority(os.PRIO_PROCESS, int(task.name), 10)
        yield url


def sweep_variant(path: Path, payloads: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    with niced_server(path, ServeSetting().args()) as url:
        base = LoadTestConfig(
            url=url,
            model=path.stem,
            rate=args.start_rate,
            duration_s=args.step_duration,
            warmup_s=1.0,
            max_lag_ms=args.max_lag_ms,
        )
        cfg = SweepConfig(
            slo_p99_ms=args.slo_p99_ms, start_rate=args.start_rate, factor=1.4, refine=2
        )
        return run_sweep(
            cfg,
            http_step_runner(base, payloads=payloads, min_requests=args.min_requests),
            {"url": url, "model": path.stem},
        )


def _markdown(doc: dict[str, Any], cmd: str) -> str:
    lines = [
        f"`{doc['task']}` served by slimline (run `{doc['run_dir']}`, selected "
        f"`{doc['selected']}`), SLO p99 {doc['slo_p99_ms']:g} ms.",
        "",
        "| variant | knee (offered rps at the SLO) | machines for the peak |",
        "|---|---:|---:|",
    ]
    for name, v in doc["variants"].items():
        if not v["knee"]:  # the sweep ran and found none: say why, as it measured
            lines.append(f"| {name} | none: {v['stopped_because']} | - |")
            continue
        machines = v["capacity"]["machines"] if v["capacity"] else None
        lines.append(f"| {name} | {v['knee']['offered_rate']:.0f} | {figure(machines, 'd')} |")
    tune = doc["tune"]
    best = tune.get("best")
    lines += [
        "",
        f"tune-serving: best {best['serve'] if best else 'none'} "
        f"({tune.get('note') or 'knee vs the default settings ' + figure(tune.get('gain_vs_default'), '.2f', 'x')}).",
    ]
    return "\n".join([*lines, *reproduce_footer(cmd)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--slo-p99-ms", type=float, default=50.0)
    ap.add_argument("--peak-qps", type=float, default=5000.0)
    ap.add_argument("--headroom", type=float, default=0.4)
    ap.add_argument("--start-rate", type=float, default=20.0)
    ap.add_argument("--step-duration", type=float, default=3.0)
    ap.add_argument("--max-lag-ms", type=float, default=10.0)
    ap.add_argument("--tune-max-configs", type=int, default=8)
    ap.add_argument(
        "--min-requests", type=int, default=200, help="requests per sweep step, at least"
    )
    ap.add_argument("--out", type=Path, required=True, help="markdown (and .json beside it)")
    args = ap.parse_args(argv)
    manifest = json.loads((args.run_dir / "manifest.json").read_text())
    variants = run_variants(args.run_dir, None)
    picks = [v for v in dict.fromkeys(["fp32-onnx", manifest["selected"]]) if v in variants]
    payloads = build_payloads(load_samples(str(args.run_dir)), "json")
    doc: dict[str, Any] = {
        "run_dir": str(args.run_dir),
        "task": manifest["task"]["name"],
        "selected": manifest["selected"],
        "slo_p99_ms": args.slo_p99_ms,
        "variants": {},
    }
    for name in picks:
        sweep = sweep_variant(variants[name], payloads, args)
        write_json(args.out.with_name(f"{args.out.stem}-sweep-{name}.json"), sweep)
        plan = (
            plan_capacity(sweep, args.peak_qps, args.slo_p99_ms, args.headroom)
            if sweep["knee"]
            else None
        )
        doc["variants"][name] = {
            "knee": sweep["knee"],
            "capacity": plan,
            "stopped_because": sweep.get("stopped_because"),
        }
    tune_cfg = TuneConfig(
        slo_p99_ms=args.slo_p99_ms,
        max_batch_sizes=[1, 8, 32],
        queue_delays_ms=[0.5, 5.0],
        instances=[1, 2],
        start_rate=args.start_rate,
        step_duration_s=args.step_duration,
        max_configs=args.tune_max_configs,
        min_requests=args.min_requests,
        max_lag_ms=args.max_lag_ms,
    )
    tune = tune_serving(args.run_dir, tune_cfg, start_server=niced_server)
    write_json(args.out.with_name(f"{args.out.stem}-tune.json"), tune)
    doc["tune"] = {
        k: tune.get(k) for k in ("best", "default", "gain_vs_default", "serve_command", "note")
    }
    doc["tune"]["configs"] = [
        {k: c[k] for k in ("variant", "serve", "stage", "knee_rate", "note")}
        for c in tune["configs"]
    ]
    cmd = "nice -n 10 " + reproduce_command("loadtest_models.py", argv)
    doc["command"] = cmd
    publish(render(doc), doc, args.out, "loadtest_models.py")
    return 0


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    return _markdown(doc, doc["command"])


if __name__ == "__main__":
    sys.exit(main())
