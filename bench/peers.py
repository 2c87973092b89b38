"""slimline's pick against the ONNX Runtime recipes a user tries first, timed in one run.

For each MODEL (a built-in recipe name, e.g. ``minilm`` or ``mnist``, or a recipe file) this runs
``slimline optimize`` and takes the candidate it selected; then it quantizes the FP32 export
(unfused) and the fused float graph (ONNX Runtime's transformer fusions or BatchNorm folding,
then ``quant_pre_process``: the graph slimline's quantize step starts from) with:

* ``quantize_dynamic`` defaults; per-channel; per-channel with ``reduce_range``;
* ``quantize_static`` defaults; U8S8 per-channel; U8S8 per-channel with ``reduce_range``
  (QDQ, MinMax on ``--samples`` calibration samples, one calibration per graph).

Every file, FP32 included, is timed in one interleaved benchmark at batch 1 with the recipe's
thread count (``slimline.measure.latency.benchmark``: rounds rotate the order). The ratio to
FP32 is the median of the per-round ratios. Fidelity is the task metric and the mean cosine to
the FP32 outputs on the evaluation data; "in budget" applies the recipe's own budget.

    nice -n 10 .venv/bin/python bench/peers.py minilm mnist --out bench/RESULTS-peers.md
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench_out import publish, reproduce_command, reproduce_footer
from slimline.candidate import Candidate
from slimline.commands import resolve_recipe
from slimline.compress.quant.calibrate import rebatch
from slimline.compress.quant.prepare import prepare, quiet
from slimline.cpu import detect
from slimline.measure.latency import benchmark
from slimline.measure.quality import Quality, evaluate, make_reference
from slimline.measure.runners import make_runner
from slimline.pipeline import run_recipe
from slimline.task import Inputs, Task, load_task

Quantizer = Callable[[Path, Path, Path], None]  # (src, dst, calibration cache)


class _Reader:
    """quantize_static's CalibrationDataReader over a task's calibration data, one row a call."""

    def __init__(self, task: Task, samples: int) -> None:
        self._rows: Iterator[Inputs] = rebatch(task.calibration_data(), 1, samples)

    def get_next(self) -> Inputs | None:
        return next(self._rows, None)


def _dynamic(**kw: Any) -> Quantizer:
    def run(src: Path, dst: Path, cache: Path) -> None:
        from onnxruntime.quantization import quantize_dynamic

        quantize_dynamic(str(src), str(dst), **kw)

    return run


def _static(task: Task, samples: int, **kw: Any) -> Quantizer:
    def run(src: Path, dst: Path, cache: Path) -> None:
        from onnxruntime.quantization import quantize_static

        reader = None if cache.exists() else _Reader(task, samples)
        quantize_static(str(src), str(dst), reader, calibration_cache_path=str(cache), **kw)

    return run


def recipes(task: Task, samples: int) -> dict[str, Quantizer]:
    from onnxruntime.quantization import QuantType

    u8s8 = {"activation_type": QuantType.QUInt8, "weight_type": QuantType.QInt8}
    return {
        "quantize_dynamic defaults": _dynamic(),
        "quantize_dynamic per-channel": _dynamic(per_channel=True),
        "quantize_dynamic per-channel reduce_range": _dynamic(per_channel=True, reduce_range=True),
        "quantize_static defaults": _static(task, samples),
        "quantize_static U8S8 per-channel": _static(task, samples, per_channel=True, **u8s8),
        "quantize_static U8S8 per-channel reduce_range": _static(
            task, samples, per_channel=True, reduce_range=True, **u8s8
        ),
    }


def peer_files(task: Task, fp32: Path, work: Path, samples: int, threads: int) -> dict[str, Path]:
    """Every recipe on the unfused export and on the fused graph; a recipe that fails is left
    out with its error printed (a peer that cannot quantize the model is no competitor)."""
    fused = prepare(fp32, work / "prepared", task.sample_inputs(1), threads=threads).path
    out: dict[str, Path] = {}
    for graph, src in (("unfused", fp32), ("fused", fused)):
        cache = work / f"{graph}-calibration.json"
        for name, quantize in recipes(task, samples).items():
            dst = work / f"{graph}-{name.replace(' ', '-')}.onnx"
            print(f"  {name} ({graph})", flush=True)
            try:
                with quiet():
                    quantize(src, dst, cache)
            except Exception as err:
                print(f"    failed: {type(err).__name__}: {err}", flush=True)
                continue
            out[f"{name} ({graph})"] = dst
    return out


def _selected(run_dir: Path) -> tuple[Path, Path, str]:
    """(FP32 export, slimline's selected file, its label) of a finished run."""
    import json

    m = json.loads((run_dir / "manifest.json").read_text())
    by_name = {c["name"]: c for c in m["candidates"]}
    sel = by_name[m["selected"]]
    fp32 = run_dir / by_name["fp32-onnx"]["artifact"]
    label = (sel.get("meta") or {}).get("label") or sel["name"]
    return fp32, run_dir / sel["artifact"], f"slimline pick: {label}"


def _ratios(lat: dict[str, Any], base: dict[str, Any]) -> list[float]:
    return [c / b for c, b in zip(lat["per_round_p50"], base["per_round_p50"], strict=True)]


def measure(model: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    recipe = resolve_recipe(model)
    print(f"[{model}] slimline optimize", flush=True)
    t0 = time.perf_counter()
    run = run_recipe(recipe, work / "run", cache=args.cache)
    optimize_s = time.perf_counter() - t0
    fp32, pick, label = _selected(run.out)
    task = load_task(recipe.task) if recipe.samples is None else run.task
    threads = recipe.target.threads
    print(f"[{model}] peers", flush=True)
    files = {"FP32 ONNX Runtime": fp32, label: pick}
    files.update(peer_files(task, fp32, work, args.samples, threads))
    cands = [Candidate(k, "peer", None, onnx=p) for k, p in files.items()]
    bench = recipe.bench.model_copy(
        update={"rounds": args.rounds, "runs_per_round": args.runs, "peak_rss": False}
    )
    print(f"[{model}] interleaved timing of {len(cands)} files", flush=True)
    lat = benchmark(cands, task.sample_inputs(1), bench, threads, throughput=False)
    reference = make_reference(make_runner(cands[0], threads), task, recipe.bench.eval_limit)
    base = lat[cands[0].name]["latency_ms"]
    rows = []
    for c in cands:
        assert c.onnx is not None
        q: Quality = evaluate(make_runner(c, threads), task, reference, recipe.bench.eval_limit)
        ratios = _ratios(lat[c.name]["latency_ms"], base)
        drop = reference.metric - q.metric
        rows.append(
            {
                "name": c.name,
                "ratio": float(np.median(ratios)),
                "ratio_band": [min(ratios), max(ratios)],
                "p50_ms": lat[c.name]["latency_ms"]["p50"],
                "cosine": q.cosine_mean,
                "metric": q.metric,
                "drop": drop,
                "size_mb": c.onnx.stat().st_size / 1e6,
                "in_budget": drop <= recipe.budget.max_metric_drop
                and q.cosine_mean >= recipe.budget.min_cosine,
            }
        )
    return {
        "model": model,
        "metric_name": task.metric_name,
        "fp32_metric": reference.metric,
        "budget": recipe.budget.model_dump(),
        "threads": threads,
        "optimize_s": optimize_s,
        "rows": rows,
    }


def verdict(r: dict[str, Any]) -> str:
    pick = r["rows"][1]
    peers = [row for row in r["rows"][2:] if row["in_budget"]]
    if not peers:
        return "no peer recipe meets the budget"
    best = min(peers, key=lambda row: row["ratio"])
    lo, hi = best["ratio_band"]
    where = (
        "ahead of"
        if pick["ratio"] <= best["ratio"]
        else ("within the band of" if pick["ratio"] <= hi else "behind")
    )
    return (
        f"slimline's pick {pick['ratio']:.3f}x FP32 is {where} the fastest peer within budget, "
        f"{best['name']} {best['ratio']:.3f}x (per-round band {lo:.3f}-{hi:.3f})"
    )


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    lines = [
        "# slimline's pick against the ONNX Runtime recipes a user tries first",
        "",
        f"CPU: {doc['cpu_text']}, {doc['cores']} cores; ONNX Runtime {doc['onnxruntime']}; "
        f"load average before: {', '.join(f'{x:.1f}' for x in doc['load_before'])}.",
        "",
    ]
    for r in doc["results"]:
        b = r["budget"]
        lines += [
            f"## {r['model']} ({r['threads']} threads; {r['metric_name']} FP32 "
            f"{r['fp32_metric']:.4f}; budget: cosine >= {b['min_cosine']}, metric drop <= "
            f"{b['max_metric_drop']}; `slimline optimize` took {r['optimize_s']:.0f} s)",
            "",
            "| candidate | x FP32 (median of per-round ratios) | per-round band | cosine | "
            "metric | size MB | in budget |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            lines.append(
                f"| {row['name']} | {row['ratio']:.3f} | {row['ratio_band'][0]:.3f}-"
                f"{row['ratio_band'][1]:.3f} | {row['cosine']:.4f} | {row['metric']:.4f} | "
                f"{row['size_mb']:.1f} | {'yes' if row['in_budget'] else 'no'} |"
            )
        lines += ["", verdict(r), ""]
    return "\n".join(lines) + "\n".join(reproduce_footer(doc["command"]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="built-in recipe names or recipe files")
    ap.add_argument("--samples", type=int, default=256, help="calibration samples of the peers")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=40, help="timed runs per file per round")
    ap.add_argument("--cache", type=Path, help="slimline's step cache (default as the CLI)")
    ap.add_argument("--out", type=Path, help="write the markdown here and its JSON beside it")
    args = ap.parse_args(argv)
    load = list(os.getloadavg())
    results = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            results.append(measure(model, Path(tmp), args))
    import onnxruntime

    cpu = detect()
    doc = {
        "command": reproduce_command("peers.py", argv),
        "cpu": cpu.to_dict(),
        "cpu_text": cpu.describe(),
        "cores": os.cpu_count(),
        "onnxruntime": onnxruntime.__version__,
        "load_before": load,
        "results": results,
    }
    publish(render(doc), doc, args.out, "peers.py")


if __name__ == "__main__":
    main()
