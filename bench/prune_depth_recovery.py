"""Which recovery recipe lifts a depth-pruned model fastest? Distil it from the drop, per variant.

The prune step drops whole layers and recovers the student by distillation (the output loss plus
each kept layer's hidden states against a teacher layer). Its settings (steps, learning rate,
weight of the hidden-state loss, which teacher layer each kept layer learns, dropout, which layers
go) decide how much of the cosine budget a recipe's 60 minutes win back. This script answers that
per variant from the same start, without a whole recipe run: for each ``--variant NAME=JSON`` it
cuts the task's model to the kept layers (``drop_layers``, as the step does), distils it with the
recipe's fine-tuning settings updated by the variant, and reports the mean cosine to the FP32
model's outputs and the task metric on the evaluation data (``slimline.api``, as the pipeline
measures), after recovery and optionally after INT8 (dynamic S8 per-channel, every layer INT8).

Variant keys: ``keep`` (layer indices kept, default ``[0, 3, 4, 5]``), ``steps``, ``lr``,
``feature_weight``, ``layer_map`` (``"kept"``: kept layer j learns teacher layer ``keep[j]``, the
step's map; ``"next"``: it learns the teacher layer just before ``keep[j + 1]``, the input the
next kept layer expects; ``"last"``: only the last layer's hidden states), ``dropout`` (false:
``finetune.dropout: false``, dropout off while distilling), ``int8`` (also quantize and measure).

    .venv/bin/python bench/prune_depth_recovery.py --fp32-run RUN_DIR --recipe minilm-prune \\
        --variant base='{"steps": 200}' --variant nodrop='{"steps": 200, "dropout": false}' \\
        --out bench/out/prune-depth-recovery.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_out import publish, reproduce_command, reproduce_footer
from prune_more_recovery import EVERY_LAYER_DYNAMIC, _quality
from slimline import StepContext, api
from slimline.candidate import Candidate
from slimline.commands import resolve_recipe
from slimline.compress.finetune import (
    DistillHooks,
    FeatureTap,
    FinetuneConfig,
    distill,
    resolve_data,
)
from slimline.compress.pruning.depth import drop_layers, find_stack
from slimline.compress.pruning.step import PruneConfig
from slimline.module_guard import private_copy
from slimline.task import Task, load_task

VARIANT_KEYS = {"keep", "steps", "lr", "feature_weight", "layer_map", "dropout", "int8"}


def map_targets(keep: list[int], layer_map: str) -> list[int]:
    """The teacher layer each kept student layer learns (``layer_map`` as in the docstring)."""
    if layer_map == "kept":
        return list(keep)
    if layer_map == "next":
        return [nxt - 1 for nxt in keep[1:]] + [keep[-1]]
    if layer_map == "last":
        return [keep[-1]]
    raise SystemExit(f"layer_map {layer_map!r}: use kept, next or last")


class PairHooks(DistillHooks):
    """Student layer ``j`` of the stack learns teacher layer ``t`` for each pair ``(j, t)``."""

    def __init__(self, path: str, pairs: list[tuple[int, int]]) -> None:
        self.names = [(f"{path}.{j}", f"{path}.{t}") for j, t in pairs]

    def feature_taps(
        self, student: Any, teacher: Any, cfg: FinetuneConfig
    ) -> tuple[FeatureTap, FeatureTap] | None:
        if cfg.feature_weight <= 0:
            return None
        return (
            FeatureTap.of_names(student, [s for s, _ in self.names]),
            FeatureTap.of_names(teacher, [t for _, t in self.names]),
        )


def _hooks(path: str, keep: list[int], layer_map: str) -> PairHooks:
    targets = map_targets(keep, layer_map)
    if layer_map == "last":
        return PairHooks(path, [(len(keep) - 1, targets[0])])
    return PairHooks(path, list(enumerate(targets)))


def run_variant(
    ctx: StepContext, task: Task, teacher: Any, base: PruneConfig, spec: dict[str, Any]
) -> dict[str, Any]:
    unknown = set(spec) - VARIANT_KEYS
    if unknown:
        raise SystemExit(f"unknown variant keys {sorted(unknown)}; use {sorted(VARIANT_KEYS)}")
    stack = find_stack(teacher, base.layers.path if base.layers else None)
    keep = list(spec.get("keep", [0, 3, 4, 5]))
    layer_map = str(spec.get("layer_map", "kept"))
    update: dict[str, Any] = {
        k: spec[k] for k in ("steps", "lr", "feature_weight", "dropout") if k in spec
    }
    ft = base.finetune.model_copy(update={**update, "patience": 10**6, "progress": False})
    student = drop_layers(private_copy(teacher).eval(), stack.path, keep)
    for p in student.parameters():
        p.requires_grad_(True)
    data, source, _ = resolve_data(task, ft)
    start = time.perf_counter()
    result = distill(
        student.train(),
        teacher,
        data,
        ft,
        output_kind=task.output_kind,
        task=task,
        desc="recovery",
        hooks=_hooks(stack.path, keep, layer_map),
    )
    seconds = time.perf_counter() - start
    after = _quality(ctx, Candidate("after", "prune", None, module=student.eval()))
    doc: dict[str, Any] = {
        "keep": keep,
        "layer_map": layer_map,
        "targets": map_targets(keep, layer_map),
        "steps": ft.steps,
        "lr": result.lr,
        "feature_weight": ft.feature_weight,
        "dropout": ft.dropout,
        "data": source,
        "seconds": round(seconds, 1),
        "after": after,
        "val_loss": [h for h in result.history if "val_loss" in h],
    }
    if spec.get("int8"):
        exported = api.export(ctx, student.eval(), name="after")
        doc["int8"] = _quality(ctx, api.quantize(ctx, exported, EVERY_LAYER_DYNAMIC))
    return doc


def depth_recovery(
    fp32_run: Path,
    recipe: str,
    variants: list[tuple[str, dict[str, Any]]],
    threads: int,
    work: Path,
    out: Path | None,
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    manifest = json.loads((fp32_run / "manifest.json").read_text())
    task = load_task(manifest["task"]["source"])
    assert task.model is not None, "a torch task"
    fp32 = next(c for c in manifest["candidates"] if c["name"] == "fp32-onnx")
    resolved = resolve_recipe(recipe)
    resolved = resolved.model_copy(
        update={"target": resolved.target.model_copy(update={"threads": threads})}
    )
    base_cand = Candidate("fp32-onnx", "export", None, onnx=fp32_run / fp32["artifact"])
    ctx = api.context_for(task, resolved, work, baseline=base_cand, timed=False)
    base = next(s for s in resolved.steps if isinstance(s, PruneConfig))
    teacher = task.model().eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    doc: dict[str, Any] = {
        "task": manifest["task"]["source"],
        "metric_name": manifest["task"]["metric_name"],
        "fp32_metric": ctx.reference.metric,
        "variants": {},
    }
    for name, spec in variants:
        doc["variants"][name] = {"spec": spec, **run_variant(ctx, task, teacher, base, spec)}
        print(json.dumps({name: doc["variants"][name]}), flush=True)
        if out is not None:  # a long comparison keeps what it has
            out.with_suffix(".partial.json").write_text(json.dumps(doc, indent=1))
    doc["warnings"] = ctx.warnings
    return doc


def _markdown(doc: dict[str, Any], cmd: str) -> str:
    m = doc["metric_name"]
    lines = [
        f"Depth recovery variants ({doc['task']}), {doc['written']}:",
        "",
        f"| variant | kept layers | hidden-state map | steps | lr | feature weight | dropout "
        f"| s | cosine to FP32 | {m} (FP32 {doc['fp32_metric']:.4f}) | + INT8 cosine | + INT8 {m} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in doc["variants"].items():
        q8 = v.get("int8")
        lines.append(
            f"| {name} | {v['keep']} | {v['layer_map']} {v['targets']} | {v['steps']} "
            f"| {v['lr']:g} | {v['feature_weight']:g} | {'on' if v['dropout'] else 'off'} "
            f"| {v['seconds']:.0f} | {v['after']['cosine']:.4f} | {v['after']['metric']:.4f} "
            f"| {q8['cosine']:.4f} | {q8['metric']:.4f} |"
            if q8
            else f"| {name} | {v['keep']} | {v['layer_map']} {v['targets']} | {v['steps']} "
            f"| {v['lr']:g} | {v['feature_weight']:g} | {'on' if v['dropout'] else 'off'} "
            f"| {v['seconds']:.0f} | {v['after']['cosine']:.4f} | {v['after']['metric']:.4f} "
            f"| - | - |"
        )
    lines += ["", *[f"- warning: {w}" for w in doc["warnings"]], *reproduce_footer(cmd)]
    return "\n".join(lines)


def _variant(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, spec = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write NAME=JSON, e.g. base='{{\"steps\": 200}}'"
        )
    value = json.loads(spec)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: the variant must be a JSON object")
    return name, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fp32-run", type=Path, required=True, help="a run dir with fp32-onnx")
    parser.add_argument("--recipe", default="minilm-prune", help="built-in recipe name or file")
    parser.add_argument("--variant", type=_variant, action="append", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="markdown (and .json beside it)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        doc = depth_recovery(
            args.fp32_run, args.recipe, args.variant, args.threads, Path(tmp), args.out
        )
    doc.update(
        command=reproduce_command("prune_depth_recovery.py", argv),
        written=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    publish(render(doc), doc, args.out, "prune_depth_recovery.py")
    return 0


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    return _markdown(doc, doc["command"])


if __name__ == "__main__":
    sys.exit(main())
