"""What each CPU kind does to INT8: the formats slimline's quantize step tries on this machine,
and the fidelity of full static INT8 PTQ in each x86 format, measured on this machine's own
kernels. Run it natively and under the emulated AVX2 lane; each run adds its kind's entry to
``bench/RESULTS-cpu-kinds.json`` (keeping the other kinds') and renders the generated section of
``bench/RESULTS-cpu-kinds.md`` from it, one part per kind.

    .venv/bin/python bench/cpu_kinds.py --out bench/RESULTS-cpu-kinds.md
    # the same under an AVX2-only CPUID (emulated: quality counts, timing would not)
    qemu-x86_64 -cpu Haswell-noTSX .venv/bin/python bench/cpu_kinds.py --out bench/RESULTS-cpu-kinds.md

Formats: U8S8 with 8-bit weights (what VNNI runs without saturating), U8S8 with 7-bit weights
(``reduce_range``) and U8U8 (what slimline tries without VNNI). Every one is static QDQ,
per-channel weights, MinMax ranges, Q/DQ at every op, first and last layers in INT8 too, no mixed
precision: the full-INT8 case that mixed precision and QAT start from. Fidelity is measured as the
pipeline measures it (``slimline.api.evaluate``: the task metric, and the cosine to FP32's
outputs on the evaluation data).
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
from slimline import api
from slimline.compress.quant.candidates import cpu_formats
from slimline.compress.quant.config import QuantizeConfig, QuantSpec
from slimline.cpu import detect
from slimline.recipe import recipe_from_dict
from slimline.task import load_task

FORMATS: dict[str, dict[str, Any]] = {
    "U8S8 8-bit weights": {"weight_type": "int8", "reduce_range": False},
    "U8S8 7-bit weights": {"weight_type": "int8", "reduce_range": True},
    "U8U8": {"weight_type": "uint8", "reduce_range": False},
}
SAMPLES = 256


def tried_here() -> list[str]:
    """The static formats the quantize step tries first on this machine, as their labels."""
    return [
        QuantSpec("static", activation_type=a, weight_type=w, reduce_range=rr).label
        for a, w, rr in cpu_formats(QuantizeConfig(), detect())
    ]


def measure_example(name: str, work: Path, eval_rows: int | None) -> dict[str, Any]:
    """FP32 and each format's full INT8 PTQ on example ``name``: metric and cosine to FP32, on
    the first ``eval_rows`` evaluation rows (all with None)."""
    task = load_task(name)
    bench = {"eval_limit": eval_rows} if eval_rows else {}
    recipe = recipe_from_dict({"name": f"cpu-kinds-{name}", "task": name, "bench": bench})
    ctx = api.context_for(task, recipe, work / name, timed=False)
    fp32 = api.evaluate(ctx, ctx.baseline)
    out: dict[str, Any] = {
        "fp32_metric": fp32.metric,
        "eval_rows": eval_rows,
        "metric_name": task.metric_name,
        "budget": {
            "max_metric_drop": recipe.budget.max_metric_drop,
            "min_cosine": recipe.budget.min_cosine,
        },
        "formats": {},
    }
    for label, fmt in FORMATS.items():
        cfg = QuantizeConfig(
            mode="static",
            calibration="minmax",
            activation_type="uint8",
            samples=SAMPLES,
            keep_first_last_float=False,
            mixed_precision=False,
            **fmt,
        )
        t0 = time.perf_counter()
        try:
            cand = api.quantize(ctx, ctx.baseline, cfg)
        except Exception as err:  # one format's failure is its result, not the run's end
            out["formats"][label] = {"failed": f"{type(err).__name__}: {err}"[:300]}
            continue
        q = api.evaluate(ctx, cand)
        out["formats"][label] = {
            "metric": q.metric,
            "metric_drop": fp32.metric - q.metric,
            "cosine_mean": q.cosine_mean,
            "within_budget": (fp32.metric - q.metric) <= recipe.budget.max_metric_drop
            and q.cosine_mean >= recipe.budget.min_cosine,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(f"{name} {label}: {out['formats'][label]}", file=sys.stderr)
    return out


def render(doc: dict[str, Any]) -> str:
    """The generated section: one part per CPU kind measured, in the order of the kinds' names."""
    return "\n\n".join(render_kind(doc[kind]) for kind in sorted(doc))


def render_kind(entry: dict[str, Any]) -> str:
    """One kind's part: its CPU, the formats slimline tries there, the fidelity table."""
    lines = [
        f"### {entry['kind']}" + (" (emulated: quality only)" if entry["emulated"] else ""),
        "",
        f"CPU as the kernels see it: {entry['cpu']}.",
        f"Static formats the quantize step tries first here: {'; '.join(entry['tried'])}.",
        "",
        "| example | FP32 | format | metric (drop) | cosine to FP32 | within budget |",
        "|---|---|---|---|---|---|",
    ]
    for name, ex in entry["examples"].items():
        if ex.get("eval_rows"):
            name = f"{name} ({ex['eval_rows']} rows)"
        for label, f in ex["formats"].items():
            if "failed" in f:
                lines.append(f"| {name} | | {label} | failed: {f['failed']} | | |")
                continue
            lines.append(
                f"| {name} | {ex['metric_name']} {ex['fp32_metric']:.3f} | {label} | "
                f"{f['metric']:.3f} ({0.0 - f['metric_drop']:+.3f}) | {f['cosine_mean']:.4f} | "
                f"{'yes' if f['within_budget'] else 'no'} |"
            )
    lines += reproduce_footer(entry["command"])
    return "\n".join(lines).rstrip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", nargs="+", default=["mnist", "mnist-rep"])
    ap.add_argument("--out", type=Path, default=None, help="RESULTS-cpu-kinds.md to update")
    ap.add_argument(
        "--eval-rows", type=int, default=None, help="evaluate on this many rows (all by default)"
    )
    args = ap.parse_args(argv)
    cpu = detect()
    entry: dict[str, Any] = {
        "kind": cpu.kind,
        "cpu": cpu.describe(),
        "emulated": cpu.proc_cpuinfo is not None,
        "tried": tried_here(),
        "command": ("qemu-x86_64 -cpu Haswell-noTSX " if cpu.proc_cpuinfo is not None else "")
        + reproduce_command("cpu_kinds.py", argv),
        "examples": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.examples:
            entry["examples"][name] = measure_example(name, Path(tmp), args.eval_rows)
    doc: dict[str, Any] = {}
    if args.out is not None and args.out.with_suffix(".json").is_file():
        doc = json.loads(args.out.with_suffix(".json").read_text())
    doc[cpu.kind] = entry
    publish(render(doc), doc, args.out, "cpu_kinds.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
