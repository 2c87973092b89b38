"""The pruning frontier of finished prune runs: what INT8 on each run's pruned model would give.

A prune run keeps its pruned model only within the accuracy budget; when it is rejected, INT8 is
built on FP32 and the run says nothing about the pruned + INT8 point it was aiming at. This script
takes the ``prune`` artifact of each run (kept or rejected), quantizes it with the quantize step
(``slimline.api``) applying to every layer the INT8 setting the first run's quantize step chose
(``--spec`` overrides), and reports per run: MACs removed,
cosine and metric of pruned + INT8 on the task's evaluation set, and its batch-1 latency against
FP32 ONNX Runtime as the median of per-round ratios, all candidates interleaved in one benchmark.

    .venv/bin/python bench/prune_frontier.py RUN_DIR [RUN_DIR ...] --rounds 12 --repeats 2 \\
        --out bench/out/prune-frontier.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench_out import figure, publish, reproduce_command, reproduce_footer
from slimline import api
from slimline.candidate import Candidate
from slimline.compress.quant.config import QuantizeConfig, QuantSpec
from slimline.measure.latency import benchmark, paired_speedup
from slimline.recipe import BenchConfig, recipe_from_dict
from slimline.task import load_task


def _manifest(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "manifest.json"
    if not path.is_file():
        raise SystemExit(f"{run_dir} is not a finished run: no manifest.json")
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest


def _by_name(manifest: dict[str, Any], name: str, run_dir: Path) -> dict[str, Any]:
    for c in manifest["candidates"]:
        if c["name"] == name and c.get("artifact"):
            return dict(c)
    raise SystemExit(f"{run_dir} has no ONNX candidate {name!r}: was it a prune run?")


def _chosen_spec(manifest: dict[str, Any]) -> QuantSpec:
    """The INT8 setting the run's quantize step chose (dynamic S8 per-channel if none)."""
    quant: dict[str, Any] = next((c for c in manifest["candidates"] if c["name"] == "quantize"), {})
    config = (quant.get("meta") or {}).get("config")
    return QuantSpec(**config) if config else QuantSpec(mode="dynamic")


def _every_layer(spec: QuantSpec, samples: int) -> QuantizeConfig:
    """The quantize step applying ``spec`` to every layer (no float layers, no mixed precision)."""
    fields = spec.to_dict()
    tables = bool(fields.pop("embeddings", False))  # the step's name for it
    fields["quantize_ops"] = fields.pop("ops")
    if fields["mode"] == "dynamic":  # the only mode that reads it
        fields["quantize_embeddings"] = tables
    return QuantizeConfig(
        **fields,
        samples=samples,
        keep_first_last_float=False,
        mixed_precision=False,
    )


def frontier(
    run_dirs: list[Path],
    spec: QuantSpec | None,
    rounds: int,
    runs: int,
    repeats: int,
    work: Path,
    samples: int = 512,
    int8_only: bool = False,
) -> dict[str, Any]:
    first = _manifest(run_dirs[0])
    task = load_task(first["task"]["source"])
    recipe = recipe_from_dict(first["recipe"])  # the first run's own target, budget and bench
    threads = recipe.target.threads
    spec = spec or _chosen_spec(first)
    sample = task.sample_inputs(1)
    base = Candidate(
        name="fp32-onnx",
        step="export",
        parent=None,
        onnx=run_dirs[0] / _by_name(first, "fp32-onnx", run_dirs[0])["artifact"],
    )
    ctx = api.context_for(task, recipe, work, baseline=base, timed=False)
    quant = _every_layer(spec, samples)
    points: list[dict[str, Any]] = []
    cands = [base]
    if int8_only:  # the unpruned model quantized the same way: what pruning must beat
        q = api.quantize(ctx, base, quant, workdir=work / "int8-only")
        cand = Candidate(name="int8-only", step="quantize", parent="fp32-onnx", onnx=q.onnx)
        quality = api.evaluate(ctx, cand)
        points.append({"run_dir": "INT8 only (unpruned)", "name": cand.name, "macs_removed": 0.0,
                       "pruned_accepted": True, "pruned_cosine": 1.0,
                       "int8_cosine": quality.fidelity_dict()["cosine_mean"],
                       "int8_metric": quality.metric,
                       "int8_kernels": q.meta["fallback_report"]})  # fmt: skip
        cands.append(cand)
    for i, run_dir in enumerate(run_dirs):
        m = _manifest(run_dir)
        pruned = _by_name(m, "prune", run_dir)
        source = Candidate("prune", "prune", None, onnx=run_dir / pruned["artifact"])
        q = api.quantize(ctx, source, quant, workdir=work / f"run{i}")
        cand = Candidate(name=f"run{i}", step="quantize", parent="prune", onnx=q.onnx)
        quality = api.evaluate(ctx, cand)
        macs = (pruned.get("meta") or {}).get("macs") or {}
        points.append(
            {
                "run_dir": str(run_dir),
                "name": cand.name,
                "macs_removed": macs.get("removed"),
                "pruned_accepted": pruned["accepted"],
                "pruned_cosine": pruned["fidelity"]["cosine_mean"],
                "int8_cosine": quality.fidelity_dict()["cosine_mean"],
                "int8_metric": quality.metric,
                "int8_kernels": q.meta["fallback_report"],
            }
        )
        cands.append(cand)
    bench = BenchConfig(rounds=rounds, runs_per_round=runs, warmup=10)
    reps, raw = [], []
    for r in range(repeats):
        res = benchmark(cands, sample, bench, threads, throughput=False, desc=f"repeat {r + 1}")
        raw.append(res)
        reps.append(
            {p["name"]: paired_speedup(res["fp32-onnx"]["latency_ms"], res[p["name"]]["latency_ms"])
             for p in points}
        )  # fmt: skip
    for p in points:
        ratios = [rep[p["name"]]["ratio"] for rep in reps]
        p["int8_ratio_per_repeat"] = ratios
        p["int8_ratio"] = float(np.median(ratios))
        if int8_only:  # paired by round: each repeat's per-round ratios against INT8 only
            vs = [_vs(res_i, p["name"]) for res_i in raw]
            p["vs_int8_only_per_repeat"] = vs
            p["vs_int8_only"] = float(np.median(vs))
    return {
        "task": first["task"]["source"],
        "metric_name": first["task"]["metric_name"],
        "fp32_metric": ctx.reference.metric,
        "spec": f"{spec.label}, no layer kept float",
        "threads": threads,
        "rounds": rounds,
        "runs": runs,
        "repeats": repeats,
        "points": points,
        "warnings": ctx.warnings,
    }


def _vs(res: dict[str, Any], name: str) -> float:
    return float(paired_speedup(res["int8-only"]["latency_ms"], res[name]["latency_ms"])["ratio"])


def _markdown(doc: dict[str, Any], cmd: str) -> str:
    metric = doc["metric_name"]
    lines = [
        f"Pruning frontier of `{doc['task']}` ({doc['spec']} on each run's pruned model; "
        f"batch 1, {doc['threads']} threads, {doc['repeats']} repeats x {doc['rounds']} "
        f"interleaved rounds x {doc['runs']} runs; {doc['written']}).",
        "",
        f"| run | MACs removed | pruned cosine (step) | pruned + INT8 cosine | {metric} (FP32 "
        f"{doc['fp32_metric']:.4f}) | runs INT8 | pruned + INT8 / FP32 ONNX: median per-round ratio "
        "(repeats) |" + (" / INT8 only (repeats) |" if _has_vs(doc) else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if _has_vs(doc) else ""),
    ]
    for p in doc["points"]:
        macs = figure(p["macs_removed"], ".1%")
        state = "kept" if p["pruned_accepted"] else "rejected"
        reps = ", ".join(f"{r:.3f}" for r in p["int8_ratio_per_repeat"])
        lines.append(
            f"| `{Path(p['run_dir']).name}` | {macs} | {p['pruned_cosine']:.4f} ({state}) | "
            f"{p['int8_cosine']:.4f} | {p['int8_metric']:.4f} | {p['int8_kernels']} | "
            f"**{p['int8_ratio']:.3f}x** ({reps}) |" + _vs_cell(p)
        )
    lines += ["", *[f"- warning: {w}" for w in doc["warnings"]]]
    lines += reproduce_footer(cmd)
    return "\n".join(lines)


def _has_vs(doc: dict[str, Any]) -> bool:
    return any("vs_int8_only" in p for p in doc["points"])


def _vs_cell(p: dict[str, Any]) -> str:
    if "vs_int8_only" not in p:
        return ""
    reps = ", ".join(f"{r:.3f}" for r in p["vs_int8_only_per_repeat"])
    return f" **{p['vs_int8_only']:.3f}x** ({reps}) |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", help="finished prune runs, one task")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--runs", type=int, default=40, help="runs per candidate per round")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512, help="calibration samples")
    parser.add_argument(
        "--spec",
        type=json.loads,
        default=None,
        help='INT8 setting as JSON, e.g. \'{"mode": "dynamic", "per_channel": true}\' '
        "(default: what the first run's quantize step chose)",
    )
    parser.add_argument(
        "--int8-only",
        action="store_true",
        help="also the unpruned model quantized the same way, and every ratio against it",
    )
    parser.add_argument("--out", type=Path, default=None, help="markdown (and .json beside it)")
    args = parser.parse_args(argv)
    spec = QuantSpec(**args.spec) if args.spec else None
    with tempfile.TemporaryDirectory() as tmp:
        doc = frontier(
            args.run_dirs,
            spec,
            args.rounds,
            args.runs,
            args.repeats,
            Path(tmp),
            args.samples,
            args.int8_only,
        )
    cmd = reproduce_command("prune_frontier.py", argv)
    doc.update(command=cmd, written=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    publish(render(doc), doc, args.out, "prune_frontier.py")
    return 0


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    return _markdown(doc, doc["command"])


if __name__ == "__main__":
    sys.exit(main())
