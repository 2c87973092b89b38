"""What a pruning plan would cost in latency, before an hour of recovery is spent on it.

Latency does not depend on the weights, only on the layer shapes. This script takes prune plans
(per-group ratios, as a run's manifest records them under ``plan`` and as a recipe's ``prune.plan``
takes them), prunes the task's model to each plan by L2 magnitude with no recovery, exports it
with the export step (every output verified against PyTorch), quantizes it with the quantize step
(dynamic S8 per-channel, no layer kept float, the setting the minilm-prune runs chose; the
table gives how many ops the runtime runs in INT8)
and times every plan interleaved against FP32 ONNX Runtime at batch 1: median per-round ratio per
repeat. It also reports each plan's MACs removed and the loss the run's sensitivity map predicts
for it (``--sweep``), so latency, MACs and predicted loss can be compared per plan.

    .venv/bin/python bench/prune_plan_latency.py --task minilm \\
        --plan shipped=@RUN_DIR --plan heads='{"encoder.encoder.layer.0.attention.self": 0.5}' \\
        --sweep ~/.cache/slimline/prune/sweeps/HASH.json --rounds 12 --repeats 2
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench_out import publish, reproduce_command, reproduce_footer
from slimline import api
from slimline.candidate import Candidate
from slimline.compress.finetune import to_tensors
from slimline.compress.pruning.graph import CostModel, PruneGraph
from slimline.compress.pruning.planner import plan_from_ratios
from slimline.compress.pruning.sensitivity import table_losses
from slimline.compress.quant.config import QuantizeConfig
from slimline.measure.latency import benchmark, paired_speedup
from slimline.recipe import BenchConfig, recipe_from_dict
from slimline.task import load_task

# dynamic S8 per-channel, no layer kept float (the setting the minilm-prune runs chose)
EVERY_LAYER_DYNAMIC: dict[str, Any] = {
    "mode": "dynamic",
    "per_channel": True,
    "keep_first_last_float": False,
    "mixed_precision": False,
}


def _plan_arg(text: str) -> tuple[str, dict[str, float]]:
    """NAME=JSON ratios, or NAME=@RUN_DIR for the plan a finished run recorded."""
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--plan {text!r}: write NAME=JSON or NAME=@RUN_DIR")
    if value.startswith("@"):
        manifest = json.loads((Path(value[1:]) / "manifest.json").read_text())
        prune = next((c for c in manifest["candidates"] if c["name"] == "prune"), None)
        if prune is None:
            raise argparse.ArgumentTypeError(f"{value[1:]} has no prune candidate")
        return name, {k: float(v) for k, v in prune["meta"]["plan"].items()}
    return name, {k: float(v) for k, v in json.loads(value).items()}


def _predicted(keep: dict[str, int], table: dict[str, Any] | None) -> float | None:
    if table is None:
        return None
    losses = table_losses(table, 1.0)
    total = 0.0
    for group, k in keep.items():
        row = table["groups"][group]
        if k == row["size"]:
            continue
        if k not in row["keep"]:
            return None  # a level the sweep did not measure
        total += losses[group][row["keep"].index(k)]
    return total


def plan_latency(
    task_name: str,
    plans: dict[str, dict[str, float]],
    table: dict[str, Any] | None,
    rounds: int,
    repeats: int,
    threads: int,
    work: Path,
    samples: int = 128,
) -> dict[str, Any]:
    import torch
    import torch_pruning as tp

    torch.set_num_threads(threads)
    task = load_task(task_name)
    recipe = recipe_from_dict(
        {"name": "plan-latency", "task": task_name, "target": {"threads": threads}}
    )
    ctx = api.context_for(task, recipe, work, timed=False)  # baseline: the verified export
    module = task.model().eval()  # type: ignore[misc]
    example = to_tensors(task.sample_inputs(2))
    sample = task.sample_inputs(1)
    quant = QuantizeConfig(**EVERY_LAYER_DYNAMIC, samples=samples)
    cands: list[Candidate] = [ctx.baseline]
    rows: list[dict[str, Any]] = []
    magnitude = tp.importance.GroupMagnitudeImportance(p=2)
    for name, ratios in plans.items():
        graph = PruneGraph(copy.deepcopy(module).eval(), example, keep_first_last=False)
        plan = plan_from_ratios(
            graph.groups, ratios, CostModel(graph), by="macs", max_ratio=0.8, round_to=8
        )
        for group, keep in plan.keep.items():
            graph.prune_to(group, keep, magnitude)
        exported = api.export(ctx, graph.model.eval(), workdir=work / f"{name}-export")
        int8 = api.quantize(ctx, exported, quant, workdir=work / f"{name}-int8")
        cands.append(Candidate(name, "quantize", None, onnx=int8.onnx))
        rows.append(
            {
                "name": name,
                "keep": {g: k for g, k in plan.keep.items() if k < graph.groups[g].size},
                "macs_removed": plan.removed,
                "predicted_loss": _predicted(plan.keep, table),
                "export_check": exported.meta["export_check"]["cosine_min"],
                "int8_label": int8.meta["label"],
                "int8_kernels": int8.meta["fallback_report"],
            }
        )
    bench = BenchConfig(rounds=rounds, runs_per_round=40, warmup=10)
    reps: list[dict[str, float]] = []
    base = ctx.baseline.name
    for r in range(repeats):
        res = benchmark(cands, sample, bench, threads, throughput=False, desc=f"repeat {r + 1}")
        reps.append(
            {row["name"]: paired_speedup(res[base]["latency_ms"], res[row["name"]]["latency_ms"])["ratio"]
             for row in rows}
        )  # fmt: skip
    for row in rows:
        row["ratio_per_repeat"] = [rep[row["name"]] for rep in reps]
        row["ratio"] = float(np.median(row["ratio_per_repeat"]))
    return {"task": task_name, "spec": f"{rows[0]['int8_label']}, no layer kept float" if rows else "-",
            "threads": threads, "rounds": rounds, "repeats": repeats,
            "opset": ctx.baseline.meta["opset"], "plans": rows, "warnings": ctx.warnings}  # fmt: skip


def _markdown(doc: dict[str, Any], cmd: str) -> str:
    lines = [
        f"Pruned + INT8 latency per plan, no recovery (`{doc['task']}`, {doc['spec']}, "
        f"exported at opset {doc['opset']} and verified against PyTorch, batch 1, "
        f"{doc['threads']} threads, {doc['repeats']} repeats x {doc['rounds']} interleaved "
        f"rounds; {doc['written']}).",
        "",
        "| plan | MACs removed | predicted loss | export check: min cosine | runs INT8 | pruned + INT8 / FP32 ONNX: median per-round ratio (repeats) |",
        "|---|---|---|---|---|---|",
    ]
    for row in doc["plans"]:
        loss = "-" if row["predicted_loss"] is None else f"{row['predicted_loss']:.3f}"
        reps = ", ".join(f"{r:.3f}" for r in row["ratio_per_repeat"])
        lines.append(
            f"| {row['name']} | {row['macs_removed']:.1%} | {loss} | {row['export_check']:.6f} | "
            f"{row['int8_kernels']} | "
            f"**{row['ratio']:.3f}x** ({reps}) |"
        )
    lines += ["", "Kept units per plan (groups not listed are whole):", ""]
    for row in doc["plans"]:
        kept = ", ".join(
            f"{g.replace('encoder.encoder.', '')}: {k}" for g, k in row["keep"].items()
        )
        lines.append(f"- {row['name']}: {kept}")
    lines += ["", *[f"- warning: {w}" for w in doc["warnings"]]]
    lines += reproduce_footer(cmd)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="minilm")
    parser.add_argument("--plan", type=_plan_arg, action="append", default=[],
                        help="NAME=JSON ratios per group, or NAME=@RUN_DIR")  # fmt: skip
    parser.add_argument("--plans", type=Path, default=None,
                        help="JSON file: {NAME: {group: ratio}}")  # fmt: skip
    parser.add_argument("--sweep", type=Path, default=None, help="sensitivity map JSON")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128, help="calibration samples")
    parser.add_argument("--out", type=Path, default=None, help="markdown (and .json beside it)")
    args = parser.parse_args(argv)
    plans = dict(args.plan)
    if args.plans:
        plans.update(json.loads(args.plans.read_text()))
    if not plans:
        parser.error("give plans with --plan NAME=... or --plans FILE")
    table = json.loads(args.sweep.read_text()) if args.sweep else None
    with tempfile.TemporaryDirectory() as tmp:
        doc = plan_latency(
            args.task,
            plans,
            table,
            args.rounds,
            args.repeats,
            args.threads,
            Path(tmp),
            args.samples,
        )
    cmd = reproduce_command("prune_plan_latency.py", argv)
    doc.update(command=cmd, written=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    publish(render(doc), doc, args.out, "prune_plan_latency.py")
    return 0


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    return _markdown(doc, doc["command"])


if __name__ == "__main__":
    sys.exit(main())
