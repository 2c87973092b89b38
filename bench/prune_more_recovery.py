"""Does more recovery pay? Continue distilling a finished prune step's model and measure again.

A prune run's last round recovers for ``final_steps`` steps. Whether a longer recovery would lift
the pruned model over the fidelity budget is a question of hours on 2 cores; this script answers it
from where the run stopped instead of from scratch. It rebuilds the pruned model from a cached
prune step (``pruned.pt`` and ``prune_history.json`` in the step-cache entry,
``torch.load(weights_only=True)``), distils it ``--steps`` more steps with the recipe's own
fine-tuning settings (learning rate ``--lr``, a fresh cosine schedule, early stopping off), and
reports the task metric and the mean cosine to the FP32 model's outputs before and after, and
after INT8: exported with the export step (verified against PyTorch, the recipe's export
settings) and quantized with the quantize step (dynamic S8 per-channel, no layer kept float: the
setting the minilm-prune runs chose), all measured as the pipeline measures (``slimline.api``).

    .venv/bin/python bench/prune_more_recovery.py STEP_CACHE_ENTRY --fp32-run RUN_DIR \\
        --recipe minilm-prune --steps 1000 --lr 5e-5 --out bench/out/prune-more-recovery.md
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
from slimline import StepContext, api
from slimline.candidate import Candidate
from slimline.commands import resolve_recipe
from slimline.compress.finetune import distill, resolve_data
from slimline.compress.pruning.depth import LayerMapHooks
from slimline.compress.pruning.step import (
    HISTORY_FILE,
    WEIGHTS_FILE,
    PruneConfig,
    restore_pruned,
)
from slimline.compress.quant.config import QuantizeConfig
from slimline.task import load_task

# dynamic S8 per-channel, no layer kept float (the setting the minilm-prune runs chose)
EVERY_LAYER_DYNAMIC = QuantizeConfig(
    mode="dynamic", per_channel=True, keep_first_last_float=False, mixed_precision=False
)


def _quality(ctx: StepContext, cand: Candidate) -> dict[str, float]:
    q = api.evaluate(ctx, cand)
    return {"metric": q.metric, "cosine": q.cosine_mean}


def more_recovery(
    entry: Path,
    fp32_run: Path,
    recipe: str,
    steps: int,
    lr: float,
    threads: int,
    work: Path,
    samples: int = 128,
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    manifest = json.loads((fp32_run / "manifest.json").read_text())
    task = load_task(manifest["task"]["source"])
    fp32 = next(c for c in manifest["candidates"] if c["name"] == "fp32-onnx")
    resolved = resolve_recipe(recipe)
    resolved = resolved.model_copy(
        update={"target": resolved.target.model_copy(update={"threads": threads})}
    )
    base = Candidate("fp32-onnx", "export", None, onnx=fp32_run / fp32["artifact"])
    ctx = api.context_for(task, resolved, work, baseline=base, timed=False)
    cfg = next(s for s in resolved.steps if isinstance(s, PruneConfig))
    ft = cfg.finetune.model_copy(
        update={"steps": steps, "lr": lr, "patience": steps + 1, "eval_every": 100}
    )
    meta = {"weights": WEIGHTS_FILE, "history_file": HISTORY_FILE}
    student = restore_pruned(entry, meta, task)
    teacher = task.model().eval()  # type: ignore[misc]
    for p in teacher.parameters():
        p.requires_grad_(False)
    before = _quality(ctx, Candidate("before", "prune", None, module=student.eval()))
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
        hooks=_layer_map(entry),
    )
    seconds = time.perf_counter() - start
    after = _quality(ctx, Candidate("after", "prune", None, module=student.eval()))
    exported = api.export(ctx, student.eval(), name="after")
    spec = EVERY_LAYER_DYNAMIC.model_copy(update={"samples": samples})
    q = api.quantize(ctx, exported, spec)
    int8 = _quality(ctx, q)
    history = [h for h in result.to_dict().get("history", []) if "val_loss" in h]
    return {
        "entry": str(entry),
        "task": manifest["task"]["source"],
        "metric_name": manifest["task"]["metric_name"],
        "fp32_metric": ctx.reference.metric,
        "steps": steps,
        "lr": lr,
        "data": source,
        "seconds": round(seconds, 1),
        "before": before,
        "after": after,
        "export": {"opset": exported.meta["opset"], **exported.meta["export_check"]},
        "int8": {
            **int8,
            "spec": f"{q.meta['label']}, no layer kept float: {q.meta['fallback_report']}",
        },
        "warnings": ctx.warnings,
        "val_loss": history,
    }


def _layer_map(entry: Path) -> LayerMapHooks | None:
    """A depth-pruned model keeps learning each kept layer from the teacher layer it came from,
    as the prune step's recovery did."""
    drops = [h for h in json.loads((entry / HISTORY_FILE).read_text()) if isinstance(h, dict)]
    if not drops:
        return None
    return LayerMapHooks(drops[-1]["path"], drops[-1]["path"], drops[-1]["keep"])


def _markdown(doc: dict[str, Any], cmd: str) -> str:
    m = doc["metric_name"]
    rows = [
        ("pruned, as the run left it", doc["before"]),
        (f"pruned, after {doc['steps']} more steps", doc["after"]),
        (f"pruned + INT8 ({doc['int8']['spec']})", doc["int8"]),
    ]
    lines = [
        f"More recovery for `{Path(doc['entry']).name}` ({doc['task']}): {doc['steps']} steps at "
        f"lr {doc['lr']:g} on {doc['data']} data, {doc['seconds']:.0f} s; "
        f"{doc['written']}.",
        "",
        f"| model | cosine to FP32 | {m} (FP32 {doc['fp32_metric']:.4f}) |",
        "|---|---|---|",
        *[f"| {name} | {q['cosine']:.4f} | {q['metric']:.4f} |" for name, q in rows],
        "",
        f"Export of the recovered model (opset {doc['export']['opset']}) verified against "
        f"PyTorch: max abs error {doc['export']['max_abs_err']:.3g}, min cosine "
        f"{doc['export']['cosine_min']:.6f}.",
        "",
        *[f"- warning: {w}" for w in doc["warnings"]],
        *reproduce_footer(cmd),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("entry", type=Path, help="step-cache entry of a prune step (pruned.pt)")
    parser.add_argument("--fp32-run", type=Path, required=True, help="a run dir with fp32-onnx")
    parser.add_argument("--recipe", default="minilm-prune", help="built-in recipe name")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128, help="calibration samples")
    parser.add_argument("--out", type=Path, default=None, help="markdown (and .json beside it)")
    args = parser.parse_args(argv)
    if not (args.entry / WEIGHTS_FILE).is_file():
        raise SystemExit(f"{args.entry} has no pruned.pt: pass a prune step's step-cache entry")
    with tempfile.TemporaryDirectory() as tmp:
        doc = more_recovery(
            args.entry,
            args.fp32_run,
            args.recipe,
            args.steps,
            args.lr,
            args.threads,
            Path(tmp),
            args.samples,
        )
    cmd = reproduce_command("prune_more_recovery.py", argv)
    doc.update(command=cmd, written=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    publish(render(doc), doc, args.out, "prune_more_recovery.py")
    return 0


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    return _markdown(doc, doc["command"])


if __name__ == "__main__":
    sys.exit(main())
