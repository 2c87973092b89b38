"""Which QAT settings win back what INT8 loses on a zoo detector: the fake-quant torch model
itself (no ONNX export, no timing), measured on the task's evaluation rows after calibration and
at intervals of distillation, one variant per run.

    .venv/bin/python bench/qat_levers.py --name entropy-lsq --calibration entropy --learn-ranges \
        --steps 60 --eval-every 20 --json /tmp/qat-levers/entropy-lsq.json

``--summarize A.json B.json ...`` prints the table of finished variants (the first one, the
MinMax start, is the reference). Each evaluation gives the task metric (text-mask IoU against FP32) and the mean cosine to FP32
of the fake-quant model's outputs. The ``qat`` step's own settings (``calibration``,
``learn_ranges``, ``range_lr``, ``finetune``) are what is varied; the final recipe-level numbers
(ONNX Runtime, interleaved latency) come from ``qat_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _evaluate(student: Any, teacher: Any, task: Any) -> dict[str, float]:
    import torch

    outs, refs, labels = [], [], []
    student.eval()
    with torch.no_grad():
        for batch, label in task.eval_data():
            x = torch.from_numpy(batch["x"])
            outs.append(student(x).numpy())
            refs.append(teacher(x).numpy())
            labels.append(label)
    out, ref = np.concatenate(outs), np.concatenate(refs)
    a, b = out.reshape(len(out), -1), ref.reshape(len(ref), -1)
    cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return {
        "metric": float(task.metric(out, np.concatenate(labels))),
        "cosine": float(cos.mean()),
    }


def summarize(paths: list[Path]) -> str:
    """A markdown table of finished variants: the fake-quant model at step 0 and at its best
    evaluation (by the smaller of its two recovered shares against the first variant's step 0,
    the MinMax start)."""
    docs = [json.loads(p.read_text()) for p in paths]
    base = docs[0]["rows"][0]
    lines = [
        "| variant | settings | step 0 IoU / cosine | best step | IoU / cosine there | "
        "recovered vs MinMax start (IoU / cosine) |",
        "|---|---|---|---|---|---|",
    ]
    for d in docs:

        def share(r: dict[str, float], key: str) -> float:
            return float((r[key] - base[key]) / (1.0 - base[key]))

        best = max(d["rows"], key=lambda r: min(share(r, "metric"), share(r, "cosine")))
        first = d["rows"][0]
        a = d["args"]
        settings = (
            f"{a['calibration']}, lr_scale {a['lr_scale']}, loss {a['loss']}"
            + (f", learned ranges at {a['range_lr']}" if a["learn_ranges"] == "True" else "")
            + (" + weight scales" if a.get("learn_weight_ranges") == "True" else "")
            + f", {a['steps']} steps"
        )
        lines.append(
            f"| {d['name']} | {settings} | {first['metric']:.3f} / {first['cosine']:.3f} | "
            f"{best['step']} | {best['metric']:.3f} / {best['cosine']:.3f} | "
            f"{share(best, 'metric'):.0%} / {share(best, 'cosine'):.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--summarize":
        print(summarize([Path(f) for f in sys.argv[2:]]))
        return 0
    p.add_argument("--name", required=True)
    p.add_argument("--task", default="zoo_ppocr_torch_task")
    p.add_argument("--calibration", choices=["minmax", "entropy", "percentile"], default="minmax")
    p.add_argument("--learn-ranges", action="store_true")
    p.add_argument("--range-lr", type=float, default=1e-3)
    p.add_argument("--learn-weight-ranges", action="store_true")
    p.add_argument("--learn-zero-points", action="store_true")
    p.add_argument("--offset-lr", type=float, default=0.5, help="zero points: steps per step")
    p.add_argument("--features", default=None, help="finetune.features regex")
    p.add_argument("--float-modules", default="", help="comma-separated modules left float")
    p.add_argument("--quantize-ops", choices=["all", "compute"], default="compute")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--lr-scale", type=float, default=0.02)
    p.add_argument("--loss", choices=["cosine", "mse", "bce"], default="cosine")
    p.add_argument("--freeze-observers-after", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)

    import importlib

    import torch

    from slimline.compress.finetune import DistillHooks, FinetuneConfig, distill
    from slimline.compress.qat import fakequant as fq
    from slimline.cpu import detect

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    task = importlib.import_module(args.task)
    teacher = task.model().eval()
    fmt = fq.format_for(
        detect(), args.quantize_ops, tuple(m for m in args.float_modules.split(",") if m)
    )
    example = {"x": torch.from_numpy(next(iter(task.calibration_data()))["x"][:2])}
    student = fq.prepare(teacher, example, fmt)
    t0 = time.perf_counter()
    fq.calibrate(student, task.calibration_data(), 512, args.calibration)
    if args.freeze_observers_after == 0:  # else the observers follow the evaluation rows too
        fq.freeze_observers(student)
    learned = (
        fq.learn_ranges(student, args.learn_weight_ranges, args.learn_zero_points)
        if args.learn_ranges
        else 0
    )
    rows: list[dict[str, Any]] = [
        {"step": 0, **_evaluate(student, teacher, task), "s": time.perf_counter() - t0}
    ]
    print(json.dumps(rows[-1]), flush=True)
    lr = 1e-3 * args.lr_scale

    class Hooks(DistillHooks):
        def before_forward(self, step: int, st: Any) -> None:
            fq.freeze_bn(st)
            if step > args.freeze_observers_after:
                fq.freeze_observers(st)

        def param_groups(self, st: Any, params: list[Any]) -> list[dict[str, Any]]:
            ranges = {id(q) for q in fq.range_parameters(st)}
            offsets = {id(q) for q in fq.offset_parameters(st)}
            rest = [q for q in params if id(q) not in ranges | offsets]
            own = [q for q in params if id(q) in ranges]
            offs = [q for q in params if id(q) in offsets]
            return (
                [{"params": rest}]
                + ([{"params": own, "lr": args.range_lr}] if own else [])
                + ([{"params": offs, "lr": args.offset_lr}] if offs else [])
            )

    def evaluate_at(step: int, loss: float) -> None:
        if step % args.eval_every == 0 or step == args.steps:
            rows.append(
                {
                    "step": step,
                    "loss": loss,
                    **_evaluate(student, teacher, task),
                    "s": time.perf_counter() - t0,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            student.train()

    if args.steps:
        cfg = FinetuneConfig(
            steps=args.steps,
            lr=lr,
            eval_every=args.steps,
            patience=99,
            embedding_loss=args.loss,
            features=args.features,
            progress=False,
            val_batches=1,
        )
        distill(
            student,
            teacher,
            task.train_data,
            cfg,
            output_kind="other",
            hooks=Hooks(),
            on_step=evaluate_at,
        )
    doc = {
        "name": args.name,
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "learned_ranges": learned,
    }
    args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
