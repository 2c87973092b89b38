"""Depth-only, width-only and combined plans priced as the prune step prices them, before any
recovery: what each shape costs in latency on this machine, and what it loses before recovery.

For every option (the ``k`` least sensitive layers dropped, ``k`` = 0 .. all droppable, then
every remaining width group thinned by each share of ``--widths``), the task's model is cut to
the shape (width by L2 magnitude), scored on the evaluation subset (metric drop + (1 - cosine),
the planner's loss before recovery), exported, quantized dynamically (S8 per-channel; the same
function, :func:`slimline.compress.pruning.pricing.price_options`, the ``prune: {layers:
{latency: ...}}`` planner runs) and timed interleaved against the unpruned model quantized the
same way: the median per-round ratio is the option's latency against INT8 alone.

    .venv/bin/python bench/prune_depth_plans.py --task minilm --widths 0.25 0.5 --rounds 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_out import publish, reproduce_command, reproduce_footer
from slimline.compress.finetune import to_tensors
from slimline.compress.pruning.depth import droppable, find_stack, layer_sensitivity
from slimline.compress.pruning.pricing import ShapeSpec, price_options
from slimline.compress.pruning.sensitivity import Evaluator
from slimline.task import load_task


def depth_plans(
    task_name: str, widths: list[float], rounds: int, threads: int, samples: int, work: Path
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    task = load_task(task_name)
    assert task.model is not None, "a torch task"
    teacher = task.model().eval()
    example = to_tensors(task.sample_inputs(2))
    stack = find_stack(teacher)
    evaluator = Evaluator(teacher, task, samples, example)
    table = layer_sensitivity(evaluator, stack, droppable(stack.size, True), 1.0)
    spec = ShapeSpec((), False, 8, 0.8, "macs")
    options = price_options(
        teacher=teacher,
        stack=stack,
        table=table,
        widths=sorted({0.0, *widths}),
        keep_first_last=True,
        spec=spec,
        evaluator=evaluator,
        fidelity_weight=1.0,
        example=example,
        sample=task.sample_inputs(1),
        workdir=work,
        opset=17,
        int8=True,
        threads=threads,
        rounds=rounds,
    )
    return {"task": task_name, "stack": stack.path, "layers": stack.size, "threads": threads,
            "rounds": rounds, "samples": evaluator.samples, "sensitivity": table,
            "options": [o.to_dict() for o in options]}  # fmt: skip


def _kind(opt: dict[str, Any]) -> str:
    if opt["dropped"] and opt["width"]:
        return "combined"
    return "depth" if opt["dropped"] else "width" if opt["width"] else "INT8 only"


def _markdown(doc: dict[str, Any], cmd: str) -> str:
    rows = sorted(doc["sensitivity"]["rows"], key=lambda r: r["loss"])
    lines = [
        f"Plans of `{doc['task']}` before recovery ({doc['stack']}, {doc['layers']} layers; "
        f"dynamic S8 per-channel INT8, batch 1, {doc['threads']} threads, {doc['rounds']} "
        f"interleaved rounds; loss on {doc['samples']} evaluation rows; "
        f"{doc['written']}).",
        "",
        "Layer sensitivity (each dropped alone): "
        + ", ".join(f"layer {r['layer']}: loss {r['loss']:.4f} (cosine {r['cosine']:.4f})" for r in rows),
        "",
        "| option | kind | layers dropped | width removed | loss before recovery | latency / INT8 only (median per-round ratio) |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for o in doc["options"]:
        loss = "-" if o["loss"] is None else f"{o['loss']:.4f}"
        ratio = f"**{o['ratio']:.3f}x**" if o["ratio"] is not None else f"failed: {o['error']}"
        lines.append(
            f"| {o['name']} | {_kind(o)} | {o['dropped'] or '-'} | {o['width']:.0%} | {loss} | "
            f"{ratio} |"
        )
    lines += reproduce_footer(cmd)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="minilm")
    parser.add_argument("--widths", type=float, nargs="*", default=[0.25, 0.5])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=50, help="evaluation rows for the loss")
    parser.add_argument("--out", type=Path, default=None, help="markdown (and .json beside it)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        doc = depth_plans(
            args.task, args.widths, args.rounds, args.threads, args.samples, Path(tmp)
        )
    doc.update(
        command=reproduce_command("prune_depth_plans.py", argv),
        written=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    publish(render(doc), doc, args.out, "prune_depth_plans.py")
    return 0


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    return _markdown(doc, doc["command"])


if __name__ == "__main__":
    sys.exit(main())
