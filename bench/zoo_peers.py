"""The zoo's yardstick: after ``slimline optimize`` picked a (runtime, candidate) pair, the
recipes a user tries first are built from the same FP32 file and calibration rows, and every one
is timed with slimline's pick in ONE interleaved benchmark and judged by the same declared
budget (``bench/zoo.py`` calls :func:`measure`).

The rows: FP32 on ONNX Runtime and on OpenVINO; slimline's pick on the runtime it picked;
ONNX Runtime's ``quantize_static`` with its defaults and with ``per_channel=True`` (on the
user's FP32 file after ``quant_pre_process``, as ONNX Runtime's documentation does it, calibrated
on the recipe's calibration rows one at a time), timed on ONNX Runtime; NNCF's PTQ as OpenVINO's documentation builds it (``ov.convert_model`` on the FP32
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
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import chdir
from pathlib import Path
from typing import Any

import numpy as np

from slimline.api import recipe_task
from slimline.candidate import Candidate
from slimline.compress.quant.calibrate import rebatch
from slimline.compress.quant.prepare import quiet
from slimline.measure.latency import benchmark
from slimline.measure.quality import Quality, Reference, evaluate, make_reference
from slimline.measure.runners import make_runner
from slimline.recipe import Recipe, load_recipe
from slimline.runtimes import pair_name
from slimline.task import Inputs, Task

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


def _preprocessed(fp32: Path, work: Path) -> Path:
    """ONNX Runtime's documented first step, ``quant_pre_process`` (shape inference and graph
    optimization: folds BatchNorm and Constant weights, which ``quantize_static`` would
    otherwise quantize as activations, per tensor), without the symbolic shape inference where
    that fails (as the tool's own option allows); the FP32 file itself where both fail."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out = (work / "preprocessed.onnx").resolve()
    for symbolic in (True, False):  # ONNX Runtime's symbolic shape inference fails on some
        if out.is_file():
            return out
        try:
            # in a scratch folder: where its symbolic shape inference fails, ONNX Runtime saves
            # the partial model as sym_shape_infer_temp.onnx in the working directory
            with tempfile.TemporaryDirectory() as tmp, chdir(tmp), quiet():
                quant_pre_process(str(fp32.resolve()), str(out), skip_symbolic_shape=not symbolic)
        except Exception:
            out.unlink(missing_ok=True)
    return out if out.is_file() else fp32


def _static(per_channel: bool) -> Callable[[Task, Path, Path, int], Path]:
    def build(task: Task, fp32: Path, dst: Path, samples: int) -> Path:
        from onnxruntime.quantization import quantize_static

        out = dst.with_suffix(".onnx")
        src = _preprocessed(fp32, dst.parent)
        quantize_static(str(src), str(out), _Reader(task, samples), per_channel=per_channel)
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
    task = recipe_task(recipe)
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
                "ratios": [round(float(x), 4) for x in ratios],
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


MIN_GAIN = 0.03  # slimline's default budget.min_gain: a smaller gain is not "faster"


def faster(row: dict[str, Any]) -> bool:
    """Faster than FP32 ONNX Runtime: in budget, a median per-round ratio of at most 1 -
    MIN_GAIN, and below 1 in at least 80% of the rounds (every round where the per-round ratios
    were not kept)."""
    ratios = row.get("ratios")
    if not row["in_budget"] or row["ratio"] > 1.0 - MIN_GAIN:
        return False
    if not ratios:
        return bool(row["band"][1] < 1.0)
    return sum(1 for x in ratios if x < 1.0) >= 0.8 * len(ratios)


def verdict(peers: dict[str, Any]) -> dict[str, Any]:
    """Whether the pick is faster than FP32 ONNX Runtime (:func:`faster`) and where it stands
    against the fastest in-budget peer recipe: ahead, within that peer's per-round band, or
    behind."""
    rows = {r["name"]: r for r in peers.get("rows", [])}
    pick = next((r for r in rows.values() if r["name"].startswith("slimline pick")), None)
    if pick is None:
        return {"faster_than_fp32": None, "vs_peer": "no pick measured"}
    # a pick that is FP32 on ONNX Runtime is the yardstick's own baseline file: two sessions of
    # one file differ only by noise, so it is never "faster" (ratios of 0.95 were seen)
    is_faster = faster(pick) and pick["name"] != f"slimline pick: fp32-onnx on {ORT}"
    ok = [r for n, r in rows.items() if n in (*PEERS, FP32_OV) and r["in_budget"]]
    if not ok:
        return {"faster_than_fp32": is_faster, "vs_peer": "no peer in budget", "peer": None}
    best = min(ok, key=lambda r: r["ratio"])
    lo, hi = best["band"]
    where = (
        "ahead"
        if pick["ratio"] <= best["ratio"]
        else ("within band" if pick["ratio"] <= hi else "behind")
    )
    return {
        "faster_than_fp32": is_faster,
        "vs_peer": where,
        "peer": best["name"],
        "peer_ratio": best["ratio"],
        "peer_band": [lo, hi],
    }


def quality_only(
    recipe_path: Path,
    run: Path,
    peers: Path,
    rows: int | None,
    pick_only: bool = False,
    extra: list[tuple[str, Path, str]] | None = None,
) -> dict[str, Any]:
    """The yardstick's fidelity columns alone, on the files a native run built and picked (no
    timing: for the emulated AVX2 lane, where only quality means anything). ``rows`` cuts the
    evaluation to its first rows; ``pick_only`` judges slimline's pick alone (FP32 on ONNX Runtime
    is the reference either way), for models too slow to run every peer under emulation;
    ``extra`` (name, file, runtime) are judged after them."""
    recipe = load_recipe(recipe_path)
    task = recipe_task(recipe)
    fp32, pick, pick_rt, label = _selected(run)
    threads = 1
    files = [(f"slimline pick: {label} on {pick_rt}", pick, pick_rt)]
    if not pick_only:
        files = [(FP32_ORT, fp32, ORT), (FP32_OV, fp32, OV), *files]
        for name, (_, rt) in BUILDERS.items():
            path = (peers / name.replace(" ", "-")).with_suffix(".xml" if rt == OV else ".onnx")
            if path.is_file():
                files.append((name, path, rt))
    files += extra or []
    limit = rows if rows is not None else recipe.bench.eval_limit
    base = Candidate(FP32_ORT, "peer", None, onnx=fp32)
    ref = make_reference(make_runner(base, threads, task.signature, ORT), task, limit)
    out: list[dict[str, Any]] = []
    for name, path, rt in files:
        cand = Candidate(name, "peer", None, onnx=path)
        try:
            q = evaluate(make_runner(cand, threads, task.signature, rt), task, ref, limit)
        except Exception as err:  # one file that this CPU cannot run: recorded, the rest go on
            out.append({"name": name, "runtime": rt, "error": f"{type(err).__name__}: {err}"})
            continue
        ok, why = within_budget(recipe, task, ref, q)
        out.append(
            {
                "name": name,
                "runtime": rt,
                "cosine": q.cosine_mean,
                "agreement": q.agreement,
                "in_budget": ok,
                "why": why,
            }
        )
    return {"rows": out, "eval_rows": limit}


def main(argv: list[str] | None = None) -> int:
    """``--quality WORK``: the fidelity columns of every model under a zoo work folder (each
    model's ``recipe.yaml``, ``run/`` and ``peers/``), as JSON; for the emulated AVX2 lane:

        OMP_NUM_THREADS=1 qemu-x86_64 -cpu Haswell-noTSX .venv/bin/python bench/zoo_peers.py \\
            --quality bench/out/zoo --out /tmp/zoo-avx2.json
    """
    import argparse

    from slimline.cpu import detect

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--quality", type=Path, required=True, help="a bench/zoo.py work folder")
    ap.add_argument("--only", nargs="+", help="these models only")
    ap.add_argument("--rows", type=int, help="the first evaluation rows only")
    ap.add_argument("--pick-only", action="store_true", help="judge slimline's pick alone")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    models: dict[str, Any] = {}
    for work in sorted(p.parent.parent for p in args.quality.glob("*/run/manifest.json")):
        if args.only and work.name not in args.only:
            continue
        print(f"quality: {work.name} ...", flush=True)
        try:
            models[work.name] = quality_only(
                work / "recipe.yaml", work / "run", work / "peers", args.rows, args.pick_only
            )
        except Exception as err:
            models[work.name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        doc = {"cpu": detect().describe(), "rows": args.rows, "models": models}
        args.out.write_text(json.dumps(doc, indent=1, default=str))  # after each model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
