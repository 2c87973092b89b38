"""The zoo's yardstick: after ``slimline optimize`` picked a (runtime, candidate) pair, the
recipes a user tries first are built from the same FP32 file and calibration rows, and every one
is timed with slimline's pick in ONE interleaved benchmark and judged by the same declared
budget (``bench/zoo.py`` calls :func:`measure`).

The rows: FP32 on ONNX Runtime and on OpenVINO; slimline's pick on the runtime it picked;
ONNX Runtime's ``quantize_static`` with its defaults and with ``per_channel=True`` (on the
user's FP32 file, calibrated on the recipe's calibration rows one at a time), timed on ONNX
Runtime; NNCF's PTQ as OpenVINO's documentation builds it (``ov.convert_model`` on the FP32
file, ``nncf.quantize`` with its defaults on the same rows), timed on OpenVINO. A recipe that
fails on a model is left out with its error (a recipe that cannot quantize the model is no
competitor).

Each row's ratio is the median of its per-round p50 ratios to FP32 ONNX Runtime in the same
rounds, with the band of those ratios. "In budget" applies the recipe's budget as slimline's
pipeline does (``StepContext.within_budget``): the declared outputs' agreement against
``min_agreement``, the undeclared outputs' worst mean cosine against ``min_cosine``, and the
metric drop where the task has a metric of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from slimline.candidate import Candidate
from slimline.compress.quant.calibrate import rebatch
from slimline.compress.quant.prepare import quiet
from slimline.measure.latency import benchmark
from slimline.measure.quality import Quality, Reference, evaluate, make_reference
from slimline.measure.runners import make_runner
from slimline.recipe import Recipe, load_recipe
from slimline.runtimes import pair_name
from slimline.task import Inputs, Task, load_task

ORT, OV = "onnxruntime", "openvino"
FP32_ORT, FP32_OV = "FP32 ONNX Runtime", "FP32 OpenVINO"
SAMPLES = 512  # calibration rows at most, as slimline's quantize step takes by default
PEERS = ("quantize_static defaults", "quantize_static per-channel", "NNCF PTQ defaults")


def _rows(task: Task, samples: int) -> Iterator[Inputs]:
    """The calibration rows one at a time (a fixed batch of 1 takes no more)."""
    return rebatch(task.calibration_data(), 1, samples, task.signature)


class _Reader:
    """quantize_static's CalibrationDataReader over the task's calibration rows."""

    def __init__(self, task: Task, samples: int) -> None:
        self._rows = _rows(task, samples)

    def get_next(self) -> Inputs | None:
        return next(self._rows, None)


def _static(per_channel: bool) -> Callable[[Task, Path, Path, int], Path]:
    def build(task: Task, fp32: Path, dst: Path, samples: int) -> Path:
        from onnxruntime.quantization import quantize_static

        out = dst.with_suffix(".onnx")
        quantize_static(str(fp32), str(out), _Reader(task, samples), per_channel=per_channel)
        return out

    return build


def _nncf(task: Task, fp32: Path, dst: Path, samples: int) -> Path:
    """OpenVINO's documented INT8 path: convert the ONNX file, then ``nncf.quantize`` with its
    defaults (subset_size 300, or every row when there are fewer)."""
    import nncf
    import openvino as ov

    rows = list(_rows(task, samples))
    model = ov.convert_model(str(fp32))
    quantized = nncf.quantize(model, nncf.Dataset(rows), subset_size=min(300, len(rows)))
    out = dst.with_suffix(".xml")
    ov.save_model(quantized, str(out))
    return out


BUILDERS: dict[str, tuple[Callable[[Task, Path, Path, int], Path], str]] = {
    PEERS[0]: (_static(False), ORT),
    PEERS[1]: (_static(True), ORT),
    PEERS[2]: (_nncf, OV),
}


def _selected(run: Path) -> tuple[Path, Path, str, str]:
    """(FP32 file, the selected file, its runtime, its label) of a finished run."""
    m = json.loads((run / "manifest.json").read_text())
    by_name = {c["name"]: c for c in m["candidates"]}
    sel = by_name[m["selected"]]
    runtime = m.get("selected_runtime") or sel.get("runtime") or ORT
    label = (sel.get("meta") or {}).get("label") or sel["name"]
    return run / by_name["fp32-onnx"]["artifact"], run / sel["artifact"], runtime, label


def load_run_task(recipe: Recipe) -> Task:
    return load_task(
        recipe.task,
        recipe.samples,
        recipe.eval_samples,
        batch_axes=recipe.batch_axes(),
        primary_output=recipe.primary_output,
        outputs=recipe.outputs,
        metric=recipe.metric,
    )


def within_budget(recipe: Recipe, task: Task, ref: Reference, q: Quality) -> tuple[bool, str]:
    """The pipeline's rule (``StepContext.within_budget``) on one quality record."""
    b = recipe.budget
    if q.metric_error is not None:
        return False, q.metric_error
    drop = ref.metric - q.metric
    by_kind = q.declared is not None and task.metric_is_fidelity
    if drop > b.max_metric_drop and not by_kind:
        return False, f"metric drop {drop:.4f}"
    if q.agreement is not None and not q.agreement >= b.min_agreement:
        return False, f"agreement {q.agreement:.4f}"
    if q.cosine_judged is not None and q.cosine_judged < b.min_cosine:
        return False, f"cosine {q.cosine_judged:.4f}"
    return True, "within budget"


def measure(recipe_path: Path, run: Path, work: Path, rounds: int, runs: int) -> dict[str, Any]:
    """Every row of the yardstick for one finished ``slimline optimize`` run (module doc)."""
    recipe = load_recipe(recipe_path)
    task = load_run_task(recipe)
    fp32, pick, pick_rt, label = _selected(run)
    threads = recipe.target.threads
    samples = SAMPLES
    rows: list[tuple[str, Path, str]] = [
        (FP32_ORT, fp32, ORT),
        (FP32_OV, fp32, OV),
        (f"slimline pick: {label} on {pick_rt}", pick, pick_rt),
    ]
    failed: dict[str, str] = {}
    build_s: dict[str, float] = {}
    work.mkdir(parents=True, exist_ok=True)
    for name, (build, rt) in BUILDERS.items():
        t0 = time.perf_counter()
        try:
            with quiet():
                path = build(task, fp32, work / name.replace(" ", "-"), samples)
        except Exception as err:  # a recipe that cannot quantize this model: no competitor
            failed[name] = f"{type(err).__name__}: {str(err)[:200]}"
            continue
        build_s[name] = round(time.perf_counter() - t0, 1)
        rows.append((name, path, rt))
    cands = {name: Candidate(name, "peer", None, onnx=path) for name, path, _ in rows}
    pairs = {pair_name(rt, name): name for name, _, rt in rows}
    bench = recipe.bench.model_copy(
        update={"rounds": rounds, "runs_per_round": runs, "peak_rss": False}
    )
    lat = benchmark(
        list(cands.values()),
        task.sample_inputs(1),
        bench,
        threads,
        throughput=False,
        signature=task.signature,
        runtimes=(ORT, OV),
        pairs=set(pairs),
    )
    limit = recipe.bench.eval_limit
    ref = make_reference(make_runner(cands[FP32_ORT], threads, task.signature, ORT), task, limit)
    base = lat[pair_name(ORT, FP32_ORT)]["latency_ms"]["per_round_p50"]
    out = []
    for name, path, rt in rows:
        entry = lat.get(pair_name(rt, name), {})
        if "latency_ms" not in entry:
            failed[name] = str(entry.get("failed", "not measured"))
            continue
        q = evaluate(make_runner(cands[name], threads, task.signature, rt), task, ref, limit)
        ok, why = within_budget(recipe, task, ref, q)
        ratios = [c / b for c, b in zip(entry["latency_ms"]["per_round_p50"], base, strict=True)]
        out.append(
            {
                "name": name,
                "runtime": rt,
                "ratio": float(np.median(ratios)),
                "band": [float(min(ratios)), float(max(ratios))],
                "p50_ms": entry["latency_ms"]["p50"],
                "cosine": q.cosine_mean,
                "agreement": q.agreement,
                "in_budget": ok,
                "why": why,
                "size_mb": round(_size(path) / 1e6, 2),
                "build_s": build_s.get(name),
            }
        )
    return {"rows": out, "failed": failed, "rounds": rounds, "runs_per_round": runs}


def _size(path: Path) -> int:
    """Bytes of the model file, with an OpenVINO IR's weights file."""
    extra = path.with_suffix(".bin") if path.suffix == ".xml" else None
    return path.stat().st_size + (extra.stat().st_size if extra and extra.is_file() else 0)


def verdict(peers: dict[str, Any]) -> dict[str, Any]:
    """Whether the pick is faster than FP32 ONNX Runtime (faster in every round) and where it
    stands against the fastest in-budget peer recipe: ahead, within that peer's per-round band,
    or behind."""
    rows = {r["name"]: r for r in peers.get("rows", [])}
    pick = next((r for r in rows.values() if r["name"].startswith("slimline pick")), None)
    if pick is None:
        return {"faster_than_fp32": None, "vs_peer": "no pick measured"}
    faster = pick["in_budget"] and pick["band"][1] < 1.0
    ok = [r for n, r in rows.items() if n in (*PEERS, FP32_OV) and r["in_budget"]]
    if not ok:
        return {"faster_than_fp32": faster, "vs_peer": "no peer in budget", "peer": None}
    best = min(ok, key=lambda r: r["ratio"])
    lo, hi = best["band"]
    where = (
        "ahead"
        if pick["ratio"] <= best["ratio"]
        else ("within band" if pick["ratio"] <= hi else "behind")
    )
    return {
        "faster_than_fp32": faster,
        "vs_peer": where,
        "peer": best["name"],
        "peer_ratio": best["ratio"],
        "peer_band": [lo, hi],
    }
