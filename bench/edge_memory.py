"""Peak RSS of the memory profile against ONNX Runtime's default settings, at batch 1.

    .venv/bin/python bench/edge_memory.py [--models minilm mnist] [--rounds 2] [--onnx NAME=PATH]
        [--out bench/RESULTS-edge-memory.md]

For each model (the verified FP32 export of the built-in example, or ``--onnx NAME=PATH``), every
setting of ``slimline.edge.memory.settings_grid`` (arena, memory patterns, execution mode, the
target's threads and one thread, arena shrinkage where input shapes vary) is measured in fresh
processes at batch 1, ``--rounds`` times interleaved: peak RSS (``VmHWM``: the process, and the
part above the post-import baseline) and p50/p99. The profile is then chosen the way
``--memory-mb`` chooses it, with a budget of 0.6x the defaults' peak. The target: peak <= 0.6x
the defaults' at <= 15% p50 cost; where no setting reaches it, the measured frontier (the
smallest peak within 15% p50, and the smallest peak of all) is written with the reason.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_out import Check, figure, publish, reproduce_command, reproduce_footer, run_check
from slimline import api, cpu, load_task
from slimline.edge.memory import MemoryBudgetError, choose, memory_profile
from slimline.examples import EXAMPLES
from slimline.recipe import recipe_from_dict

TARGET_RATIO, MAX_P50_COST = 0.6, 0.15


def _export(name: str, work: Path) -> tuple[Path, Any]:
    task = load_task(name)
    recipe = recipe_from_dict({"name": f"edge-{name}", "task": name, "target": {"threads": 2}})
    ctx = api.context_for(task, recipe, work / name, timed=False)
    assert ctx.baseline.onnx is not None
    return ctx.baseline.onnx, task


def _profile(onnx: Path, sample: Any, threads: int, rounds: int, runs: int) -> dict[str, Any]:
    """Every setting at batch 1; chosen under 0.6x the defaults' peak (or the no-fit error)."""
    # an unbounded budget gives every row; the choice under 0.6x is made below
    prof = memory_profile(onnx, sample, [1], threads, 1e9, runs=runs, rounds=rounds)
    default = prof["default"]
    budget = TARGET_RATIO * default["peak_rss_mb"]
    try:
        prof["chosen"] = choose(prof["rows"], budget)
        prof["no_fit"] = None
    except MemoryBudgetError as err:
        prof["chosen"] = None
        prof["no_fit"] = str(err)
    prof["budget_mb"] = budget
    return prof


def _ratios(row: dict[str, Any], default: dict[str, Any]) -> dict[str, float]:
    return {
        "peak": row["peak_rss_mb"] / default["peak_rss_mb"],
        "model": row["model_rss_mb"] / max(default["model_rss_mb"], 1e-9),
        "p50": row["p50_ms"] / default["p50_ms"],
        "p99": row["p99_ms"] / default["p99_ms"],
    }


def _frontier(prof: dict[str, Any]) -> dict[str, Any]:
    rows = [r for r in prof["rows"] if "error" not in r]
    default = prof["default"]
    within = [r for r in rows if r["p50_ms"] <= (1 + MAX_P50_COST) * default["p50_ms"]]
    best_within = min(within, key=lambda r: r["peak_rss_mb"])
    least = min(rows, key=lambda r: r["peak_rss_mb"])
    return {
        "least_within_cost": {**best_within, "ratios": _ratios(best_within, default)},
        "least_peak": {**least, "ratios": _ratios(least, default)},
    }


def _check(name: str, prof: dict[str, Any]) -> Check:
    def judge() -> tuple[bool, str]:
        chosen, default = prof["chosen"], prof["default"]
        if chosen is None:
            return False, f"no setting under {TARGET_RATIO}x the defaults' peak ({prof['no_fit']})"
        r = _ratios(chosen, default)
        ok = r["peak"] <= TARGET_RATIO and r["p50"] <= 1 + MAX_P50_COST
        return ok, (
            f"{chosen['label']}: peak {r['peak']:.2f}x ({chosen['peak_rss_mb']:.1f} vs "
            f"{default['peak_rss_mb']:.1f} MB), p50 {r['p50']:.2f}x"
        )

    return run_check(f"{name}: peak <= {TARGET_RATIO}x at <= 15% p50 cost", judge)


def _rows_table(prof: dict[str, Any]) -> list[str]:
    default = prof["default"]
    lines = [
        "| setting | peak RSS MB | above imports MB | peak / default | p50 ms | p99 ms | p50 / default |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted((r for r in prof["rows"] if "error" not in r), key=lambda r: r["peak_rss_mb"]):
        q = _ratios(r, default)
        mark = " (defaults)" if r is default or r["label"] == default["label"] else ""
        lines.append(
            f"| {r['label']}{mark} | {r['peak_rss_mb']:.1f} | {r['model_rss_mb']:.1f} | "
            f"{q['peak']:.2f}x | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {q['p50']:.2f}x |"
        )
    for r in prof["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} | | | | | |")
    return lines


def _section(name: str, prof: dict[str, Any]) -> list[str]:
    lw, lp = prof["least_within_cost"], prof["least_peak"]
    default, check = prof["default"], prof["check"]
    met = "met" if check["status"] == "passed" else "not met"
    lines = [
        f"### {name} ({prof['model']}, {prof['file_mb']:.1f} MB file, "
        f"{'varying' if prof['varying_shapes'] else 'fixed'} input shapes)",
        "",
        f"- defaults ({default['label']}): peak {figure(default['peak_rss_mb'], '.1f', ' MB')} "
        f"({figure(default['model_rss_mb'], '.1f', ' MB')} above the imports), p50 "
        f"{figure(default['p50_ms'], '.3f', ' ms')}",
        f"- profile chosen under {TARGET_RATIO}x the defaults' peak "
        f"({prof['budget_mb']:.1f} MB): "
        + (
            f"{prof['chosen']['label']}, peak {prof['chosen']['peak_rss_mb']:.1f} MB"
            if prof["chosen"]
            else f"none ({prof['no_fit']})"
        ),
        f"- target: {met} ({check['detail']})",
        f"- frontier: smallest peak within 15% p50: {lw['label']}, {lw['ratios']['peak']:.2f}x "
        f"the defaults' peak ({lw['ratios']['model']:.2f}x above the imports), p50 "
        f"{lw['ratios']['p50']:.2f}x; smallest peak of all: {lp['label']}, "
        f"{lp['ratios']['peak']:.2f}x at p50 {lp['ratios']['p50']:.2f}x",
        "",
        *_rows_table(prof),
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["minilm", "mnist"])
    ap.add_argument("--onnx", nargs="*", default=[], help="NAME=PATH: also measure this file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--out", type=Path, default=None, help="markdown (and .json beside it)")
    args = ap.parse_args(argv)
    kind = cpu.detect()
    doc: dict[str, Any] = {
        "command": reproduce_command("edge_memory.py", argv),
        "cpu": f"{kind.kind} ({', '.join(sorted(kind.features))})",
        "cores": os.cpu_count(),
        "threads": args.threads,
        "load_start": os.getloadavg(),
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        targets: list[tuple[str, Path, Any]] = []
        for name in args.models:
            onnx, task = _export(name, Path(tmp))
            targets.append((name, onnx, task.sample_inputs))
        for spec in args.onnx:
            name, _, path = spec.partition("=")
            # an example's own graph under another name takes the example's inputs; any other
            # file is its own task (inputs made from the graph's signature)
            prefix = name.split("-")[0]
            task = load_task(prefix if prefix in EXAMPLES else path)
            targets.append((name, Path(path), task.sample_inputs))
        for name, onnx, sample in targets:
            prof = _profile(onnx, sample, args.threads, args.rounds, args.runs)
            check = _check(name, prof)
            size = {"file_mb": onnx.stat().st_size / 2**20}
            doc["models"][name] = {**prof, **size, "check": check.to_dict(), **_frontier(prof)}
            print(f"{name}: {check.status} {check.detail}", file=sys.stderr)
    publish(render(doc), doc, args.out, "edge_memory.py")
    return 0


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    lines = [
        "## Memory profile at batch 1 (issue 17)",
        "",
        f"CPU: {doc['cpu']}, {doc['cores']} cores; {doc['threads']} target threads; measured "
        "while other jobs shared the machine (load average "
        f"{doc['load_start'][0]:.1f} at the start).",
        "Peak RSS is the whole process's VmHWM (Python, numpy and ONNX Runtime imported, about "
        "70 MB before any model); 'above imports' is the part above the post-import RSS.",
        "",
    ]
    for name, prof in doc["models"].items():
        lines += _section(name, prof)
    return "\n".join([*lines, *reproduce_footer(doc["command"])])


if __name__ == "__main__":
    sys.exit(main())
