"""OpenVINO INT8 that holds (issue 27, item 3): on zoo models, NNCF's ONNX backend (as slimline
built it before, on the model's own opset, and as it builds it now, on an opset-13 graph), NNCF's
documented OpenVINO path (``ov.convert_model`` + ``nncf.quantize`` with defaults, an IR), and
slimline's static QDQ, each judged on ONNX Runtime and OpenVINO against FP32 ONNX Runtime: the
worst output's mean cosine, and the declared kind's agreement where bench/fidelity_kinds.py
declares one.

Every candidate is built natively for both CPU kinds whose INT8 choice differs (``vnni``: 8-bit
weights, NNCF's default overflow fix; ``avx2``: 7-bit QDQ weights and U8U8, NNCF's overflow fix
on every convolution), from the same calibration rows, into ``--work``. Quality is then measured
on the CPU at hand; run it again under the emulated AVX2 lane (quality only) on the same files.
Timing (``--timing``, native, under the flock) interleaves FP32 and the host kind's candidates on
both runtimes at batch 1 and gives each pair's p50 as a multiple of FP32 ONNX Runtime's.

    flock /tmp/slimline-timing.lock nice -n 5 .venv/bin/python bench/ov_int8.py --timing \\
        --out bench/RESULTS-ov-int8.md
    OMP_NUM_THREADS=1 qemu-x86_64 -cpu Haswell-noTSX .venv/bin/python bench/ov_int8.py \\
        --no-build --rows 2 --out bench/RESULTS-ov-int8.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import zoo
from bench_out import publish, reproduce_command, reproduce_footer
from fidelity_kinds import DECLARED
from slimline import api
from slimline.candidate import Candidate
from slimline.compress.nncf_ov import nncf_ov_quantize
from slimline.compress.nncf_ptq import NncfConfig, calibration_items, nncf_quantize_onnx
from slimline.compress.quant.config import QuantizeConfig
from slimline.cpu import CpuInt8, detect
from slimline.recipe import BenchConfig, recipe_from_dict

HERE = Path(__file__).resolve().parent
MODELS = ("ddddocr-det", "ppocr-det", "ppocr-cls", "ppocr-rec")
THREADS = 2
# the two x86 kinds whose INT8 choice differs (tests/fixtures/int8_kinds.py)
FORMATS = {
    "vnni": CpuInt8("x86_64", frozenset({"avx2", "avx512bw", "avx512_vnni"})),
    "avx2": CpuInt8("x86_64", frozenset({"avx2"})),
}
# candidate -> what it is; built per format unless the format is named
CANDIDATES = {
    "nncf-onnx-before": "NNCF ONNX backend on the model's own opset (slimline before: per-tensor "
    "weights below opset 13), NNCF's defaults",
    "nncf-onnx-signed": "the same ONNX-backend file as nncf-onnx/avx2 (overflow fix on every "
    "layer) with NNCF's signed INT8 activation pairs, as slimline wrote it before re-encoding "
    "them as UINT8 (compress/qdq_unsigned.py)",
    "nncf-onnx": "NNCF ONNX backend on an opset-13 graph (slimline now), overflow fix by kind",
    "nncf-ov": "NNCF's documented path: ov.convert_model + nncf.quantize, an OpenVINO IR, "
    "overflow fix by kind",
    "qdq": "slimline static QDQ, U8S8 per-channel MinMax, first/last layers float (7-bit weights "
    "for avx2)",
    "qdq-u8u8": "slimline static QDQ, U8U8 (the other format slimline tries without VNNI)",
}
BENCH_SETTINGS: dict[str, Any] = {
    "rounds": 5,
    "runs_per_round": 40,
    "warmup": 5,
    "batch_sizes": [1],
    "peak_rss": False,
}
BENCH = "5 rounds x 40 runs, 5 warm-up runs"
ONLY_FORMAT = {"nncf-onnx-before": "vnni", "nncf-onnx-signed": "avx2", "qdq-u8u8": "avx2"}


def recipe_doc(name: str, work: Path, runtime: str, rows: int | None) -> dict[str, Any]:
    m = zoo.BY_NAME[name]
    doc: dict[str, Any] = {
        "version": 1,
        "name": f"ov-int8-{name}",
        "task": str(zoo.model_path(m)),
        "samples": str(work / "calibration.npz"),
        "eval_samples": str(work / "evaluation.npz"),
        "target": {"threads": THREADS, "runtime": runtime},
        "budget": {"min_cosine": 0.99, "max_metric_drop": 1.0},
        "bench": {"eval_limit": rows} if rows else {},
    }
    if name in DECLARED:
        doc["outputs"] = DECLARED[name][0]
        doc["budget"]["min_agreement"] = 0.99
    return doc


def context(name: str, work: Path, runtime: str, rows: int | None) -> Any:
    recipe = recipe_from_dict(recipe_doc(name, work, runtime, rows))
    task = api.recipe_task(recipe)
    return api.context_for(task, recipe, work / f"ctx-{runtime}", timed=False, cache=work / "cache")


def _nncf_before(ctx: Any, out: Path) -> dict[str, Any]:
    """The ONNX-backend candidate as slimline built it before: the model's own opset."""
    import nncf
    import onnx

    items = calibration_items(ctx.task.calibration_data(), ctx.task.signature, 300)
    model = onnx.load(str(ctx.baseline.onnx))
    softmax = any(n.op_type == "Softmax" for n in model.graph.node)
    t0 = time.perf_counter()
    q = nncf.quantize(
        model,
        nncf.Dataset(items),
        subset_size=len(items),
        model_type=nncf.ModelType.TRANSFORMER if softmax else None,
    )
    onnx.save(q, str(out))
    return {"calibration_items": len(items), "wall_s": round(time.perf_counter() - t0, 1)}


def _qdq(ctx: Any, out: Path, fmt: str, u8u8: bool) -> dict[str, Any]:
    cfg = QuantizeConfig(
        mode="static",
        calibration="minmax",
        weight_type="uint8" if u8u8 else "int8",
        reduce_range=fmt == "avx2" and not u8u8,
        mixed_precision=False,
    )
    cand = api.quantize(ctx, ctx.baseline, cfg, workdir=out.parent / f"q-{out.stem}")
    assert cand.onnx is not None
    shutil.copy(cand.onnx, out)
    return {"label": cand.meta["label"]}


def build_one(ctx: Any, cand: str, fmt: str, where: Path) -> tuple[Path, dict[str, Any]]:
    cpu, src = FORMATS[fmt], Path(ctx.baseline.onnx)
    calib = ctx.task.calibration_data()
    cfg = NncfConfig()
    if cand == "nncf-ov":
        path = where / f"{cand}.xml"
        return path, nncf_ov_quantize(src, calib, path, cfg, ctx.task.signature, cpu)
    path = where / f"{cand}.onnx"
    if cand == "nncf-onnx":
        return path, nncf_quantize_onnx(src, calib, path, cfg, ctx.task.signature, cpu)
    if cand == "nncf-onnx-before":
        return path, _nncf_before(ctx, path)
    if cand == "nncf-onnx-signed":  # the fix on every layer, on a kind that re-encodes nothing
        signed = NncfConfig(overflow_fix="enable")
        return path, nncf_quantize_onnx(
            src, calib, path, signed, ctx.task.signature, FORMATS["vnni"]
        )
    return path, _qdq(ctx, path, fmt, u8u8=cand == "qdq-u8u8")


def build(name: str, work: Path) -> dict[str, Any]:
    """Inputs and every candidate of ``name`` for both formats, into ``work``."""
    m = zoo.BY_NAME[name]
    assert m.inputs is not None
    calibration, evaluation = m.inputs(zoo.model_path(m))
    work.mkdir(parents=True, exist_ok=True)
    np.savez(work / "calibration.npz", **calibration)  # type: ignore[arg-type]
    np.savez(work / "evaluation.npz", **evaluation)  # type: ignore[arg-type]
    ctx = context(name, work, "onnxruntime", None)
    built: dict[str, Any] = {}
    for fmt in FORMATS:
        for cand in CANDIDATES:
            if ONLY_FORMAT.get(cand, fmt) != fmt:
                continue
            (work / fmt).mkdir(exist_ok=True)
            try:
                path, meta = build_one(ctx, cand, fmt, work / fmt)
                built[f"{cand}/{fmt}"] = {"file": str(path.relative_to(work)), "meta": meta}
            except Exception as err:  # one candidate's failure is its result
                built[f"{cand}/{fmt}"] = {"failed": f"{type(err).__name__}: {err}"[:300]}
            print(f"ov-int8: built {name} {cand}/{fmt}", file=sys.stderr, flush=True)
    return {"kind": m.kind, "built": built, "rows": {"calibration": _rows(calibration)}}


def _rows(arrays: dict[str, np.ndarray]) -> int:
    return len(next(iter(arrays.values())))


def _figures(q: Any) -> dict[str, Any]:
    return {"cosine": q.cosine_mean, "agreement": q.agreement}


def quality(name: str, work: Path, built: dict[str, Any], rows: int | None) -> dict[str, Any]:
    """Each built file on each runtime that runs it, against FP32 ONNX Runtime's outputs."""
    out: dict[str, Any] = {"fp32": {}, **{k: {} for k in built}}  # rows in build order
    for rt in ("onnxruntime", "openvino"):
        ctx = context(name, work, rt, rows)
        out["fp32"][rt] = _figures(api.evaluate(ctx, ctx.baseline))
        for key, b in built.items():
            if "file" not in b or (rt == "onnxruntime" and b["file"].endswith(".xml")):
                continue
            cand = Candidate(key, "bench", "fp32-onnx", onnx=work / b["file"])
            try:
                out[key][rt] = _figures(api.evaluate(ctx, cand))
            except Exception as err:
                out[key][rt] = {"failed": f"{type(err).__name__}: {err}"[:200]}
            print(f"ov-int8: {name} {key} on {rt}: {out[key][rt]}", file=sys.stderr, flush=True)
    return out


def ov_precisions(work: Path, built: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per file, OpenVINO's compiled convolutions by the precision they run in (its runtime
    model's ``runtimePrecision``): whether OpenVINO runs a file's convolutions in INT8."""
    import openvino as ov

    from slimline.measure.ov import ov_settings

    core, out = ov.Core(), {}
    for key, b in built.items():
        if "file" not in b:
            continue
        compiled = core.compile_model(str(work / b["file"]), "CPU", ov_settings(THREADS))
        counts: dict[str, int] = {}
        for op in compiled.get_runtime_model().get_ops():
            info = op.get_rt_info()
            layer = info["layerType"].astype(str) if "layerType" in info else ""
            if layer in ("Convolution", "GroupConvolution", "Deconvolution"):
                prec = info["runtimePrecision"].astype(str)
                counts[prec] = counts.get(prec, 0) + 1
        out[key] = counts
    return out


def timing(name: str, work: Path, built: dict[str, Any], fmt: str) -> dict[str, Any]:
    """FP32 and ``fmt``'s candidates on both runtimes, interleaved at batch 1: each pair's p50
    and its ratio to FP32 ONNX Runtime's."""
    from slimline.measure.latency import benchmark
    from slimline.runtimes import pair_name

    ctx = context(name, work, "auto", None)
    cands = [ctx.baseline] + [
        Candidate(k, "bench", "fp32-onnx", onnx=work / b["file"])
        for k, b in built.items()
        if k.endswith(f"/{fmt}") and "file" in b and not k.startswith("nncf-onnx-before")
    ]
    pairs = {pair_name(rt, c.name) for c in cands for rt in ("onnxruntime", "openvino")}
    pairs -= {pair_name("onnxruntime", c.name) for c in cands if str(c.onnx).endswith(".xml")}
    bench = BenchConfig(**BENCH_SETTINGS)
    figures = benchmark(
        cands,
        ctx.task.sample_inputs(1),
        bench,
        THREADS,
        throughput=False,
        signature=ctx.task.signature,
        runtimes=["onnxruntime", "openvino"],
        pairs=pairs,
    )
    base = figures[pair_name("onnxruntime", "fp32-onnx")]["latency_ms"]["p50"]
    return {
        k: {"p50_ms": f["latency_ms"]["p50"], "ratio": f["latency_ms"]["p50"] / base}
        if "latency_ms" in f
        else f
        for k, f in figures.items()
    }


# --- rendering ------------------------------------------------------------------------------


def _cell(f: dict[str, Any] | None, key: str) -> str:
    if not f:
        return ""
    if "failed" in f:
        return "failed"
    v = f.get(key)
    return "" if v is None else f"{v:.4f}"


def render_quality(kind: str, q: dict[str, Any]) -> list[str]:
    emulated = " (emulated: quality only)" if q["emulated"] else ""
    lines = [
        f"### Quality on {kind}{emulated}",
        "",
        f"CPU as the kernels see it: {q['cpu']}. Cosine: the worst output's mean per-row cosine "
        "to FP32 ONNX Runtime; agreement: the declared kind's (bench/fidelity_kinds.py).",
        "",
        "| model (rows) | candidate | built for | ORT cosine | OV cosine | ORT agreement | "
        "OV agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    commands = []
    for model, entry in q["models"].items():
        commands.append(entry["command"])
        for key, f in entry["results"].items():
            cand, _, fmt = key.partition("/")
            ort, ov = f.get("onnxruntime"), f.get("openvino")
            lines.append(
                f"| {model} ({entry['rows']}) | {cand} | {fmt or '-'} | {_cell(ort, 'cosine')} | "
                f"{_cell(ov, 'cosine')} | {_cell(ort, 'agreement')} | {_cell(ov, 'agreement')} |"
            )
    return [*lines, *(x for c in dict.fromkeys(commands) for x in reproduce_footer(c))]


def render_timing(kind: str, t: dict[str, Any]) -> list[str]:
    lines = [
        f"### Latency on {kind} (native)",
        "",
        f"p50 at batch 1, {THREADS} threads, as a multiple of FP32 ONNX Runtime's; each model's "
        f"pairs interleaved in one run ({BENCH}), the files built for this kind.",
        "",
        "| model | pair | p50 ms | x FP32 ORT | 1-min load before/after |",
        "|---|---|---|---|---|",
    ]
    commands = []
    for model, r in t["models"].items():
        commands.append(r["command"])
        load = "{} / {}".format(*r["load_1min"])
        for pair, f in r["pairs"].items():
            if "p50_ms" not in f:
                lines.append(f"| {model} | {pair} | failed | | {load} |")
                continue
            lines.append(f"| {model} | {pair} | {f['p50_ms']:.2f} | {f['ratio']:.3f} | {load} |")
    return [*lines, *(x for c in dict.fromkeys(commands) for x in reproduce_footer(c))]


def render_precisions(kind: str, p: dict[str, Any]) -> list[str]:
    lines = [
        f"### The precision OpenVINO runs each file's convolutions in, on {kind}",
        "",
        "From the compiled model's runtime graph (`runtimePrecision` of each Convolution, "
        "GroupConvolution and Deconvolution): u8/i8 run on INT8 kernels, f32 in float.",
        "",
        "| model | candidate | built for | convolutions by runtime precision |",
        "|---|---|---|---|",
    ]
    commands = []
    for model, entry in p["models"].items():
        commands.append(entry["command"])
        for key, counts in entry["files"].items():
            cand, _, fmt = key.partition("/")
            text = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            lines.append(f"| {model} | {cand} | {fmt} | {text} |")
    return [*lines, *(x for c in dict.fromkeys(commands) for x in reproduce_footer(c))]


def render(doc: dict[str, Any]) -> str:
    lines = [
        "## OpenVINO INT8 on zoo models",
        "",
        "Candidates (each built from the same calibration rows):",
        "",
        *(f"- `{k}`: {v}" for k, v in CANDIDATES.items()),
        "",
    ]
    for kind in sorted(doc.get("quality", {})):
        lines += [*render_quality(kind, doc["quality"][kind]), ""]
    for kind in sorted(doc.get("precisions", {})):
        lines += [*render_precisions(kind, doc["precisions"][kind]), ""]
    for kind in sorted(doc.get("timing", {})):
        lines += [*render_timing(kind, doc["timing"][kind]), ""]
    return "\n".join(lines).rstrip()


# --- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--work", type=Path, default=HERE / "out" / "ov-int8")
    ap.add_argument("--rows", type=int, default=None, help="evaluation rows (all by default)")
    ap.add_argument("--no-build", action="store_true", help="judge the files a run built")
    ap.add_argument("--no-quality", action="store_true", help="skip the quality measurement")
    ap.add_argument("--timing", action="store_true", help="also time (native, under the flock)")
    ap.add_argument(
        "--precisions", action="store_true", help="record the precision OpenVINO runs convs in"
    )
    ap.add_argument("--out", type=Path, default=None, help="RESULTS-ov-int8.md to update")
    ap.add_argument("--render", action="store_true", help="only render --out from its JSON")
    args = ap.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    if args.render:
        assert args.out is not None
        doc = _read(args.out)
        publish(render(doc), doc, args.out, "ov_int8.py")
        return 0
    cpu = detect()
    emulated = cpu.proc_cpuinfo is not None  # CPUID and /proc/cpuinfo disagree: an emulator
    command = reproduce_command("ov_int8.py", given)
    for name in args.only:
        work = args.work / name
        built = found(work) if args.no_build else build(name, work)
        new: dict[str, Any] = {}
        if not args.no_quality:
            new["quality"] = {
                "rows": _eval_rows(work, args.rows),
                "command": command,
                "results": quality(name, work, built["built"], args.rows),
            }
        if args.precisions:
            new["precisions"] = {"command": command, "files": ov_precisions(work, built["built"])}
        if args.timing and not emulated:
            new["timing"] = {"command": command, **timed(name, work, built["built"], cpu)}
        doc = _read(args.out)  # another run may have written its kind meanwhile
        models = doc.setdefault("models", {})
        if not args.no_build or name not in models:
            models[name] = built  # --no-build keeps what the building run recorded
        for part, entry in new.items():
            kind = doc.setdefault(part, {}).setdefault(cpu.kind, {"models": {}})
            kind.update(cpu=cpu.describe(), emulated=emulated)
            kind["models"][name] = entry
        publish(render(doc), doc, args.out, "ov_int8.py")
    return 0


def _eval_rows(work: Path, limit: int | None) -> int:
    with np.load(work / "evaluation.npz") as z:
        rows = _rows({k: z[k] for k in z.files})
    return min(rows, limit) if limit else rows


def _read(out: Path | None) -> dict[str, Any]:
    path = out.with_suffix(".json") if out else None
    return json.loads(path.read_text()) if path and path.is_file() else {}


def found(work: Path) -> dict[str, Any]:
    """What an earlier run built into ``work`` (``--no-build``)."""
    built = {}
    for fmt in FORMATS:
        for cand in CANDIDATES:
            for ext in (".onnx", ".xml"):
                if (work / fmt / f"{cand}{ext}").is_file():
                    built[f"{cand}/{fmt}"] = {"file": f"{fmt}/{cand}{ext}"}
    return {"built": built}


def timed(name: str, work: Path, built: dict[str, Any], cpu: CpuInt8) -> dict[str, Any]:
    """:func:`timing` of the files built for ``cpu``'s kind, with the 1-minute load average
    before and after."""
    before = os.getloadavg()[0]
    pairs = timing(name, work, built, "avx2" if cpu.u8s8_saturates else "vnni")
    return {"pairs": pairs, "load_1min": [round(before, 2), round(os.getloadavg()[0], 2)]}


if __name__ == "__main__":
    sys.exit(main())
