"""INT8 quantization side by side: FP32 ONNX Runtime, ``quantize_static`` defaults,
``quantize_dynamic`` defaults, and slimline's automatic quantize step, on ``minilm`` (the real
all-MiniLM-L6-v2 on the Lee corpus, sequence length 128) and a ResNet-18-shaped CNN at 224x224
(synthetic weights and inputs: speed only).

For each model the four ONNX files are timed in one interleaved run at batch 1 (rounds rotate
A B C D, B C D A, ...; figures are medians over rounds with the min-max band of the per-round
medians), with the target's thread count. Quality is the task metric and the cosine of the
outputs against FP32 on the evaluation data. Calibration time and peak RSS (the increase over the
process's RSS before the call, sampled every 20 ms) are given for the calibrated variants.

    nice -n 10 .venv/bin/python bench/quantize_bench.py --out bench/RESULTS-quantize.md

The FP32 graph is the export step's (every output verified against PyTorch), slimline's variant
is the quantize step's, and quality is measured as the pipeline measures it (``slimline.api``).

``--models minilm`` or ``--models resnet18`` runs one; ``--rounds``/``--runs`` set the timing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench_out import figure, publish, reproduce_command, reproduce_footer
from slimline import StepContext, api
from slimline.candidate import Candidate
from slimline.compress.quant.calibrate import RssSampler, rebatch
from slimline.compress.quant.config import QuantizeConfig
from slimline.compress.quant.prepare import quiet
from slimline.measure.host import busy_cores
from slimline.measure.quality import Quality
from slimline.recipe import Recipe
from slimline.task import Inputs, Task, load_task

THREADS = 2
CALIBRATED = ("quantize_static defaults", "slimline auto")  # variants with a calibration pass


# --- models ------------------------------------------------------------------------------------


def resnet18() -> Any:
    """ResNet-18's shape (BasicBlocks 2-2-2-2, 64-512 channels, 1000 classes), seeded weights."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
            self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
            self.down = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                if stride != 1 or cin != cout
                else None
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    class ResNet18(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(3, 64, 7, 2, 3, bias=False),
                nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.MaxPool2d(3, 2, 1),
            )
            blocks, cin = [], 64
            for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                blocks += [Block(cin, cout, stride), Block(cout, cout, 1)]
                cin = cout
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(512, 1000)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.blocks(self.stem(x))
            out: torch.Tensor = self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
            return out

    torch.manual_seed(0)
    model = ResNet18()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert m.running_mean is not None and m.running_var is not None
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.1, 0.1)
    return model.eval()


def _images(seed: int, n: int) -> Inputs:
    return {"x": np.random.RandomState(seed).randn(n, 3, 224, 224).astype(np.float32)}


def resnet_task(samples: int) -> Task:
    model = resnet18()

    def calibration() -> Iterator[Inputs]:
        for i in range(0, samples, 16):
            yield _images(i, min(16, samples - i))

    def evaluation() -> Iterator[tuple[Inputs, None]]:
        for i in range(4):
            yield _images(10_000 + i, 16), None

    return Task(
        name="resnet18-shaped",
        source="bench",
        calibration_data=calibration,
        eval_data=evaluation,
        metric=lambda out, lab: 0.0,  # synthetic weights: fidelity to FP32 is the measure
        metric_name="none (synthetic)",
        output_kind="logits",
        model=lambda: model,
    )


# --- the four variants -------------------------------------------------------------------------


class _Reader:
    """quantize_static's CalibrationDataReader over a task's calibration batches, one row a call."""

    def __init__(self, task: Task, samples: int) -> None:
        self._rows = rebatch(task.calibration_data(), 1, samples)

    def get_next(self) -> Inputs | None:
        return next(self._rows, None)


def ort_static_defaults(task: Task, src: Path, dst: Path, samples: int) -> dict[str, Any]:
    from onnxruntime.quantization import quantize_static

    with RssSampler() as rss, quiet():
        base, t0 = rss.peak, time.perf_counter()
        quantize_static(str(src), str(dst), _Reader(task, samples))
        wall = time.perf_counter() - t0
    return {"calibration_s": wall, "peak_rss_mb": (rss.peak - base) / 2**20}


def ort_dynamic_defaults(src: Path, dst: Path) -> dict[str, Any]:
    from onnxruntime.quantization import quantize_dynamic

    t0 = time.perf_counter()
    with quiet():
        quantize_dynamic(str(src), str(dst))
    return {"calibration_s": None, "quantize_s": time.perf_counter() - t0, "peak_rss_mb": None}


def _recipe(budget: dict[str, Any], rounds: int, runs: int) -> Recipe:
    return Recipe(
        name="bench",
        task="bench",
        target={"threads": THREADS},
        budget=budget,
        bench={
            "rounds": rounds,
            "runs_per_round": runs,
            "warmup": 10,
            "batch_sizes": [1],
            "peak_rss": False,
        },
    )


def slimline_auto(ctx: StepContext, samples: int, work: Path) -> tuple[Path, dict[str, Any]]:
    """The quantize step in automatic mode on the context's FP32 baseline."""
    with RssSampler() as rss:
        start = rss.peak
        t0 = time.perf_counter()
        out = api.quantize(ctx, ctx.baseline, QuantizeConfig(samples=samples), workdir=work)
        wall = time.perf_counter() - t0
    assert out.onnx is not None
    meta = out.meta
    return out.onnx, {
        "calibration_s": meta["calibration"]["wall_s"],
        "peak_rss_mb": meta["calibration"]["peak_rss_mb"] - start / 2**20,
        "step_s": wall,
        "label": meta["label"],
        "kernels": meta["fallback_report"],
        "no_candidate_met_budget": meta.get("no_candidate_met_budget"),
        "timings": meta.get("timings_s"),
        "warnings": ctx.warnings,
    }


# --- measurement -------------------------------------------------------------------------------


def _kernels(path: Path) -> str:
    from slimline.compress.quant.fallback import kernel_report

    return str(kernel_report(path, THREADS)["summary"])


def run_model(
    name: str, task: Task, budget: dict[str, Any], samples: int, rounds: int, runs: int, tmp: Path
) -> dict[str, Any]:
    print(f"[{name}] export (verified)", flush=True)
    ctx = api.context_for(task, _recipe(budget, rounds, runs), tmp / name)
    fp32 = ctx.baseline.onnx
    assert fp32 is not None
    files: dict[str, Path] = {"FP32 ONNX Runtime": fp32}
    info: dict[str, dict[str, Any]] = {"FP32 ONNX Runtime": {}}
    print(f"[{name}] quantize_static defaults", flush=True)
    files["quantize_static defaults"] = tmp / f"{name}-static.onnx"
    info["quantize_static defaults"] = ort_static_defaults(
        task, fp32, files["quantize_static defaults"], samples
    )
    print(f"[{name}] quantize_dynamic defaults", flush=True)
    files["quantize_dynamic defaults"] = tmp / f"{name}-dynamic.onnx"
    info["quantize_dynamic defaults"] = ort_dynamic_defaults(
        fp32, files["quantize_dynamic defaults"]
    )
    print(f"[{name}] slimline auto", flush=True)
    files["slimline auto"], info["slimline auto"] = slimline_auto(
        ctx, samples, tmp / f"{name}-auto"
    )
    cands = [Candidate(k, "bench", None, onnx=p) for k, p in files.items()]
    print(f"[{name}] interleaved timing", flush=True)
    lat = ctx.compare(cands)
    rows = []
    for c in cands:
        assert c.onnx is not None
        q: Quality = api.evaluate(ctx, c)
        rows.append(
            {
                "variant": c.name,
                "latency": lat[c.name]["latency_ms"],
                "quality": q,
                "kernels": _kernels(c.onnx),
                **info[c.name],
            }
        )
    return {
        "name": name,
        "rows": rows,
        "fp32_metric": ctx.reference.metric,
        "metric_name": task.metric_name,
        "export_check": ctx.baseline.meta["export_check"],
        "opset": ctx.baseline.meta["opset"],
    }


# --- report ------------------------------------------------------------------------------------


def _cpu() -> str:
    from slimline.record import hardware

    hw = hardware()
    vnni = "avx512_vnni" in hw.get("flags", []) or "avx_vnni" in hw.get("flags", [])
    return f"{hw.get('cpu') or platform.machine()} ({'VNNI' if vnni else 'no VNNI'})"


def _conditions(before: float | None, after: float | None, wall: float) -> str:
    """What the machine was doing around the bench, as measured (``measure.host.busy_cores``)."""
    import onnxruntime

    return (
        f"Machine: {_cpu()}, {os.cpu_count()} cores, {THREADS} threads per session, ONNX Runtime "
        f"{onnxruntime.__version__}. Other processes used {figure(before, '.1f')} cores in the "
        f"second before the bench and {figure(after, '.1f')} in the second after it. Bench wall "
        f"time {wall / 60:.1f} min. The ratios come from one interleaved run per model."
    )


def _calibration(row: dict[str, Any], key: str, fmt: str) -> str:
    """A calibration figure; "-" for a variant that does not calibrate (FP32, dynamic)."""
    if row["variant"] not in CALIBRATED:
        return "-"
    return figure(row.get(key), fmt)


def _model_section(r: dict[str, Any]) -> list[str]:
    base = r["rows"][0]["latency"]["p50"]
    check = r["export_check"]
    lines = [
        f"## {r['name']} (batch 1; metric {r['metric_name']}, FP32 {r['fp32_metric']:.4f})",
        "",
        f"FP32 export (opset {r['opset']}) verified against PyTorch: max abs error "
        f"{check['max_abs_err']:.3g}, min cosine {check['cosine_min']:.6f}.",
        "",
        "| variant | p50 ms | band (per-round p50) | latency / FP32 | runs INT8 | cosine mean | cosine min | metric | calibration s | calib. peak RSS +MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lat, q = row["latency"], row["quality"]
        lines.append(
            f"| {row['variant']} | {lat['p50']:.2f} | {lat['band'][0]:.2f}-{lat['band'][1]:.2f} | "
            f"{lat['p50'] / base:.3f}x | {row['kernels']} | {q['cosine_mean']:.4f} | "
            f"{q['cosine_min']:.4f} | {q['metric']:.4f} | {_calibration(row, 'calibration_s', '.1f')} | "
            f"{_calibration(row, 'peak_rss_mb', '.0f')} |"
        )
    auto = r["rows"][-1]
    lines += [
        "",
        f"slimline auto chose **{auto['label']}**; the whole step (prepare, calibrate "
        f"{figure(auto['calibration_s'], '.0f')} s, quantize and evaluate every candidate, "
        f"interleaved timing, layer-wise error) took {auto['step_s']:.0f} s: {auto['timings']}.",
    ]
    if auto.get("no_candidate_met_budget"):
        lines.append(f"\nNo candidate met the budget: {auto['no_candidate_met_budget']}")
    return [*lines, "", *[f"- warning: {w}" for w in auto["warnings"]], ""]


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    lines = [
        "# INT8 quantization: FP32 vs ONNX Runtime's defaults vs slimline automatic mode",
        "",
        doc["conditions"],
        "",
    ]
    for r in doc["models"]:
        lines += _model_section(r)
    lines += _targets(doc["models"])
    return "\n".join([*lines, *reproduce_footer(doc["command"])])


# issue 3's targets: (model, what, measured value of a result, bound, higher is better)
_TARGETS: list[tuple[str, str, str, float, bool]] = [
    ("minilm", "latency / FP32 ORT", "ratio", 0.50, False),
    ("minilm", "mean cosine of embeddings", "cosine", 0.99, True),
    ("minilm", "metric change vs FP32 (Lee Pearson, within 0.01)", "metric_drop", 0.01, False),
    ("minilm", "whole quantize step, s", "step_s", 180.0, False),
    ("resnet18", "latency / FP32 ORT", "ratio", 0.36, False),
    ("resnet18", "whole quantize step, s", "step_s", 180.0, False),
]


def _measured(r: dict[str, Any], what: str) -> float:
    fp32, auto = r["rows"][0], r["rows"][-1]
    if what == "ratio":
        return float(auto["latency"]["p50"] / fp32["latency"]["p50"])
    if what == "cosine":
        return float(auto["quality"]["cosine_mean"])
    if what == "metric_drop":
        return float(fp32["quality"]["metric"] - auto["quality"]["metric"])
    return float(auto["step_s"])


def _targets(results: list[dict[str, Any]]) -> list[str]:
    """Issue 3's targets against this run's slimline auto figures (only the models measured)."""
    by_name = {r["name"]: r for r in results}
    rows = []
    for model, what, key, bound, higher in _TARGETS:
        if model not in by_name:
            continue
        value = _measured(by_name[model], key)
        met = value >= bound if higher else value <= bound
        sign = ">=" if higher else "<="
        rows.append(
            f"| {model} | {what} {sign} {bound:g} | {value:.4g} | {'yes' if met else 'no'} |"
        )
    if not rows:
        return []
    head = ["## Against the targets (issue 3), slimline auto in this run", ""]
    return [*head, "| model | target | measured | met |", "|---|---|---|---|", *rows, ""]


def _doc(results: list[dict[str, Any]], conditions: str, command: str) -> dict[str, Any]:
    """The JSON beside the markdown: every figure, Quality records as plain dicts."""
    return {
        "command": command,
        "conditions": conditions,
        "models": [
            {**r, "rows": [{**row, "quality": vars(row["quality"])} for row in r["rows"]]}
            for r in results
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models", nargs="+", default=["minilm", "resnet18"], choices=["minilm", "resnet18"]
    )
    ap.add_argument("--samples", type=int, default=512, help="calibration samples")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=40, help="timed runs per candidate per round")
    ap.add_argument("--out", type=Path, default=Path("bench/RESULTS-quantize.md"))
    args = ap.parse_args(argv)
    busy_before, t0 = busy_cores(1.0), time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            if name == "minilm":
                task, budget = load_task("minilm"), {"max_metric_drop": 0.01, "min_cosine": 0.99}
            else:
                task, budget = (
                    resnet_task(args.samples),
                    {"max_metric_drop": 1.0, "min_cosine": 0.99},
                )
            results.append(
                run_model(name, task, budget, args.samples, args.rounds, args.runs, Path(tmp))
            )
    wall = time.perf_counter() - t0
    conditions = _conditions(busy_before, busy_cores(1.0), wall)
    command = "nice -n 10 " + reproduce_command("quantize_bench.py", argv)
    doc = _doc(results, conditions, command)
    publish(render(doc), doc, args.out, "quantize_bench.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
