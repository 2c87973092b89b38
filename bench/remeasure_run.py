"""Time a finished run's ONNX candidates again, interleaved, several times over: how much of a
latency ratio is the model and how much the machine.

A run's final benchmark is one interleaved measurement (5 rounds by default). On a VM whose speed
switches between modes for seconds at a time, a round where the baseline and a candidate ran in
different modes gives a ratio off by the mode factor, and with 5 rounds two such rounds move the
median. This script re-times the run's artifacts (batch 1, the run's threads and sample input,
latency only) in ``--repeats`` independent interleaved measurements of ``--rounds`` rounds each,
and reports per repeat the median per-round ratio against the baseline, plus the spread of the
per-round p50s, which shows the modes.

    .venv/bin/python bench/remeasure_run.py RUN_DIR --candidates fp32-onnx prune quantize \\
        --rounds 8 --repeats 3 --out bench/out/remeasure.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from bench_out import publish, reproduce_command, reproduce_footer
from slimline.candidate import Candidate
from slimline.measure.latency import benchmark, paired_speedup
from slimline.recipe import BenchConfig
from slimline.task import load_task


def _candidates(
    run_dir: Path, names: list[str], other: dict[str, Path] | None = None
) -> list[Candidate]:
    """The run's ONNX candidates named in ``names``; a name in ``other`` is that ONNX file
    instead (a model another run built, e.g. INT8 alone against this run's pruned + INT8)."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    known = {c["name"]: c for c in manifest["candidates"]}
    out = []
    for n in names:
        if other and n in other:
            out.append(Candidate(name=n, step="other", parent=None, onnx=other[n]))
            continue
        c = known.get(n)
        if c is None or not c.get("artifact"):
            have = sorted(k for k, v in known.items() if v.get("artifact"))
            raise SystemExit(f"{run_dir} has no ONNX candidate {n!r}; it has {have}")
        out.append(
            Candidate(name=n, step=c["step"], parent=c.get("parent"), onnx=run_dir / c["artifact"])
        )
    return out


def remeasure(
    run_dir: Path,
    names: list[str],
    rounds: int,
    runs: int,
    repeats: int,
    throughput: bool = False,
    other: dict[str, Path] | None = None,
) -> dict[str, Any]:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    threads = int(manifest["target"]["threads"])
    sample = load_task(manifest["task"]["source"]).sample_inputs(1)
    cands = _candidates(run_dir, names, other)
    bench = BenchConfig(rounds=rounds, runs_per_round=runs, warmup=10)
    base = names[0]
    reps = []
    for i in range(repeats):
        t0 = time.perf_counter()
        res = benchmark(
            cands, sample, bench, threads, throughput=throughput, desc=f"repeat {i + 1}"
        )
        rep: dict[str, Any] = {"seconds": time.perf_counter() - t0, "candidates": {}}
        for n in names:
            lat = res[n]["latency_ms"]
            pair = paired_speedup(res[base]["latency_ms"], lat)
            rep["candidates"][n] = {
                "per_round_p50": lat["per_round_p50"],
                "p50": lat["p50"],
                "ratio_of_p50s": lat["p50"] / res[base]["latency_ms"]["p50"],
                "median_round_ratio": pair["ratio"],
                "round_ratios": pair["ratios"],
            }
        reps.append(rep)
        print(
            json.dumps({n: round(c["median_round_ratio"], 3) for n, c in rep["candidates"].items()})
        )
    return {
        "run_dir": str(run_dir),
        "threads": threads,
        "rounds": rounds,
        "runs": runs,
        "repeats": reps,
    }


def _markdown(doc: dict[str, Any], names: list[str], cmd: str) -> str:
    base = names[0]
    lines = [
        f"Re-timed `{doc['run_dir']}` at batch 1, {doc['threads']} threads, "
        f"{len(doc['repeats'])} repeats x {doc['rounds']} interleaved rounds x {doc['runs']} runs "
        f"({doc['written']}).",
        "",
        "| repeat | "
        + " | ".join(f"{n}: median per-round ratio (range)" for n in names[1:])
        + f" | {base} per-round p50 ms (min-max) |",
        "|---|" + "---|" * len(names),
    ]
    for i, rep in enumerate(doc["repeats"], 1):
        cells = []
        for n in names[1:]:
            c = rep["candidates"][n]
            rr = c["round_ratios"]
            cells.append(f"{c['median_round_ratio']:.3f}x ({min(rr):.2f}-{max(rr):.2f})")
        b = rep["candidates"][base]["per_round_p50"]
        lines.append(f"| {i} | " + " | ".join(cells) + f" | {min(b):.1f}-{max(b):.1f} |")
    meds = {
        n: float(np.median([r["candidates"][n]["median_round_ratio"] for r in doc["repeats"]]))
        for n in names[1:]
    }
    lines += [
        "",
        "Median over repeats: " + ", ".join(f"{n} {v:.3f}x" for n, v in meds.items()) + ".",
        *reproduce_footer(cmd),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--candidates", nargs="+", default=["fp32-onnx", "prune", "quantize"],
        help="ONNX candidates of the run; the first is the baseline",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--runs", type=int, default=60, help="runs per candidate per round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--throughput",
        action="store_true",
        help="also run the final benchmark's throughput passes (batch 1/8/32) after each "
        "latency block, as a run does, to see whether they bias the batch-1 figures",
    )
    parser.add_argument(
        "--other",
        nargs="*",
        default=[],
        metavar="NAME=ONNX",
        help="ONNX files from elsewhere, timed as candidates NAME (list NAME in --candidates)",
    )
    parser.add_argument("--out", type=Path, default=None, help="markdown (and .json beside it)")
    args = parser.parse_args(argv)
    other = {}
    for item in args.other:
        name, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            parser.error(f"--other {item!r}: expected NAME=PATH of an existing ONNX file")
        other[name] = Path(path)
    if len(args.candidates) < 2:
        parser.error("--candidates needs a baseline and at least one candidate")
    try:
        BenchConfig(rounds=args.rounds, runs_per_round=args.runs)
    except ValidationError as err:
        parser.error(err.errors()[0]["msg"])
    doc = remeasure(
        args.run_dir, args.candidates, args.rounds, args.runs, args.repeats, args.throughput, other
    )
    cmd = reproduce_command("remeasure_run.py", argv)
    doc.update(
        command=cmd,
        shown=args.candidates,
        written=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    publish(render(doc), doc, args.out, "remeasure_run.py")
    return 0


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    return _markdown(doc, doc["shown"], doc["command"])


if __name__ == "__main__":
    sys.exit(main())
