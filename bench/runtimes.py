"""ONNX Runtime vs OpenVINO, chosen by measurement: FP32 and INT8 on both runtimes, and the
``runtime: auto`` pick, on the built-in recipes.

Each model runs its built-in recipe with ``target.runtime: auto`` and ``quantize: {nncf:
true}``: every candidate (FP32, slimline's QDQ INT8, NNCF's INT8) is measured on both runtimes
in ONE interleaved benchmark (the pipeline's final measurement: rounds rotate over every
(runtime, candidate) pair), quality is measured on each runtime's own outputs, peak RSS in a
fresh process per pair. The table reads the run's manifest; ratios are the median per-round
ratio to FP32 ONNX Runtime of the same run. The wall time of the whole ``optimize`` is given too.

    nice -n 10 .venv/bin/python bench/runtimes.py --out bench/RESULTS-runtimes.md

``--models mnist`` runs one; ``--rounds`` sets the final benchmark's rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench_out import Check, claim, figure, publish, reproduce_command, reproduce_footer, run_check
from slimline.commands import builtin_recipes
from slimline.cpu import detect
from slimline.measure.host import busy_cores
from slimline.pipeline import run_recipe
from slimline.recipe import load_recipe, recipe_from_dict

BASE = ("fp32-onnx", "onnxruntime")
# (label, candidate, runtime): the table's rows, in order
ROWS = [
    ("FP32 ORT", "fp32-onnx", "onnxruntime"),
    ("FP32 OpenVINO", "fp32-onnx", "openvino"),
    ("INT8 ORT, slimline QDQ", "quantize", "onnxruntime"),
    ("INT8 OpenVINO, slimline QDQ", "quantize", "openvino"),
    ("INT8 ORT, NNCF", "quantize-nncf", "onnxruntime"),
    ("INT8 OpenVINO, NNCF", "quantize-nncf", "openvino"),
]


# the depthwise CNN has no built-in recipe: the mnist recipe's steps and budget, on its task file
TASK_FILES = {"depthwise": Path(__file__).parent / "depthwise_task.py"}


def _recipe(model: str, rounds: int | None) -> Any:
    raw = load_recipe(builtin_recipes()[model if model not in TASK_FILES else "mnist"]).to_dict()
    if model in TASK_FILES:
        raw["task"] = str(TASK_FILES[model].resolve())
    raw["name"] = f"{model}-runtimes"
    raw["target"]["runtime"] = "auto"
    for st in raw["steps"]:
        if "quantize" in st:
            st["quantize"] = {**(st["quantize"] or {}), "nncf": True}
    if rounds:
        raw["bench"]["rounds"] = rounds
    return recipe_from_dict(raw)


def _figures(manifest: dict[str, Any], cand: str, runtime: str) -> dict[str, Any] | None:
    c = next((c for c in manifest["candidates"] if c["name"] == cand), None)
    if c is None:
        return None
    f = (c.get("runtimes") or {}).get(runtime)
    return None if f is None else {**f, "accepted": c["accepted"], "meta": c.get("meta", {})}


def _paired_ratio(f: dict[str, Any], base: dict[str, Any]) -> float:
    a, b = f["latency_ms"]["per_round_p50"], base["latency_ms"]["per_round_p50"]
    return float(np.median([x / y for x, y in zip(a, b, strict=True)]))


def _verdict(f: dict[str, Any], cand: str, runtime: str) -> str:
    if cand == "fp32-onnx":
        return "baseline"
    v = (f["meta"].get("runtime_verdicts") or {}).get(runtime)
    if v is None:
        return "-"
    return "kept" if v["accepted"] else "rejected: " + v["reason"].split(":")[0]


def _row(label: str, f: dict[str, Any] | None, base: dict[str, Any], cand: str, rt: str) -> str:
    if f is None:
        return f"| {label} | {figure(None)} | | | | | | | |"
    if "failed" in f:
        return f"| {label} | {_failure(f['failed'])} | | | | | | | |"
    if "latency_ms" not in f:  # rejected on this runtime: its verdict's figures, not re-timed
        return _judged_row(label, f, cand, rt)
    lat = f["latency_ms"]
    size = f.get("size_bytes")
    return (
        f"| {label} | {lat['p50']:.3f} | {lat['band'][0]:.3f}-{lat['band'][1]:.3f} | "
        f"{_paired_ratio(f, base):.3f}x | {f['fidelity']['cosine_mean']:.5f} | "
        f"{f['metric']['value']:.4f} | {figure(f.get('peak_rss_mb'), '.1f')} | "
        f"{figure(size / 1e6 if size else None, '.2f')} | {_verdict(f, cand, rt)} |"
    )


def _judged_row(label: str, f: dict[str, Any], cand: str, rt: str) -> str:
    """A pair its step was rejected on: not in the final benchmark (it cannot be the pick);
    the p50 and ratio are from its accept/reject comparison against its parent."""
    j = f.get("judged") or {}
    timed = (
        f"{j['p50_ms']:.3f} ms, {j['ratio']:.3f}x {j['against']} (its accept/reject comparison)"
        if j
        else "not timed"
    )
    size = f.get("size_bytes")
    return (
        f"| {label} | {timed} | | | {f['fidelity']['cosine_mean']:.5f} | "
        f"{f['metric']['value']:.4f} | | {figure(size / 1e6 if size else None, '.2f')} | "
        f"{_verdict(f, cand, rt)} |"
    )


def _failure(message: str) -> str:
    """The runtime's refusal, shortened to the op it names where it names one."""
    _, _, detail = message.partition("detailed log: -- ")
    text = detail or message
    return "cannot load: " + text[:160].replace("|", "/") + ("..." if len(text) > 160 else "")


def _footer_argv(argv: list[str]) -> list[str]:
    """The command that measures again: without --rerender and --reuse (and their models)."""
    out: list[str] = []
    skipping = False
    for a in argv:
        if a.startswith("--"):
            skipping = a in ("--reuse", "--rerender")
        if not skipping:
            out.append(a)
    return out


def _pick_check(manifest: dict[str, Any]) -> Check:
    """The pick is no slower than the faster runtime's best pair within budget, within its
    band: the fastest in-budget pair's p50 must not sit below the pick's band."""

    def check() -> tuple[bool, str]:
        pick = manifest["runtime_pick"]
        pairs = [p for p in pick["pairs"] if p["within_budget"]]
        best = min(pairs, key=lambda p: p["p50_ms"])
        f = _figures(manifest, pick["candidate"], pick["runtime"])
        assert f is not None
        lo = f["latency_ms"]["band"][0]
        ok = best["p50_ms"] >= lo
        return ok, (
            f"pick {pick['candidate']} on {pick['runtime']} {pick['p50_ms']:.3f} ms (band from "
            f"{lo:.3f}); fastest in-budget pair {best['candidate']} on {best['runtime']} "
            f"{best['p50_ms']:.3f} ms"
        )

    return run_check("auto pick within the band of the fastest in-budget pair", check)


def run_model(
    model: str, rounds: int | None, work: Path, rerender: bool, reuse: bool
) -> dict[str, Any]:
    """Run the model's recipe into ``work/model`` (or, with ``rerender``, read the run a
    previous invocation left there) and return its manifest and wall time. With ``reuse`` the
    steps, decisions and figures an earlier run left in the step cache are reused, so the wall
    time is not the optimize command's and is not reported."""
    out = work / model
    if not rerender:
        t0 = time.perf_counter()
        run_recipe(_recipe(model, rounds), out, remeasure=not reuse)
        wall = {"wall_s": None if reuse else round(time.perf_counter() - t0, 1)}
        (out / "bench-wall.json").write_text(json.dumps(wall))
    manifest = json.loads((out / "manifest.json").read_text())
    wall_s = json.loads((out / "bench-wall.json").read_text())["wall_s"]
    return {"model": model, "wall_s": wall_s, "manifest": manifest}


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    cpu = doc["cpu"]
    lines = [
        "# Runtimes: ONNX Runtime vs OpenVINO, and the `runtime: auto` pick",
        "",
        f"CPU kind **{cpu['kind']}** (features: {', '.join(cpu['features'])}), "
        f"{doc['cores']} cores. What else ran during each model's final benchmark is given "
        "below it (other processes' cores, load average); the ratios come from one interleaved "
        "benchmark per model and are the figures to quote.",
        "",
        "Each model: its built-in recipe with `target.runtime: auto` and `quantize: {nncf: "
        "true}`. Every (runtime, candidate) pair that can be the pick (FP32 on each runtime, "
        "each candidate on each runtime its step was kept on) is timed in the same interleaved "
        "rounds at batch 1; a pair rejected on its runtime shows the p50 of its accept/reject "
        "comparison against its parent instead (no RSS: it is not re-run). "
        "Ratio = median per-round ratio to FP32 ONNX Runtime; fidelity = mean cosine "
        "to the FP32 PyTorch outputs on that runtime's own outputs; peak RSS in a fresh process. "
        "OpenVINO runs with INFERENCE_NUM_THREADS = the target's threads, the LATENCY hint, no "
        "hyper-threading and f32 inference precision (on this AMX CPU its default would run FP32 "
        "models in bf16). The quantize step's own search (which QDQ setting) is timed on ONNX "
        "Runtime; its pick and NNCF's model are then judged per runtime.",
        "",
    ]
    for r in doc["models"]:
        lines += _model_section(r)
    lines += reproduce_footer(doc["command"])
    return "\n".join(lines)


def _model_section(r: dict[str, Any]) -> list[str]:
    pairs = r["pairs"]
    base = pairs.get("/".join(BASE))
    pick = r["runtime_pick"] or {}
    cond = r["conditions"] or {}
    lines = [
        f"## {r['model']}",
        "",
        f"Final benchmark: other processes used {figure(cond.get('other_cores_before'), '.1f')}"
        f" cores before and {figure(cond.get('other_cores_after'), '.1f')} after, load "
        f"average {figure(cond.get('load_before'), '.1f')} on {cond.get('cores', '?')} cores.",
        "",
        f"`slimline optimize` with `runtime: auto` took **{figure(r['wall_s'], '.0f', ' s')}"
        f"** wall ({r['threads']} threads"
        f"{'' if r['wall_s'] else '; this run reused the step cache of an earlier one'}). "
        "Pick: "
        f"**{pick.get('candidate')} on {pick.get('runtime')}**.",
        "",
        "| pair | p50 ms | p50 band | x FP32 ORT | cosine | metric | peak RSS MB | size MB "
        "| step on this runtime |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if base is None or "failed" in base:
        return [*lines, "FP32 ONNX Runtime not measured: no ratios."]
    for label, cand, rt in ROWS:
        lines.append(_row(label, pairs.get(f"{cand}/{rt}"), base, cand, rt))
    cand, rt = pick.get("candidate", ""), pick.get("runtime", "")
    lines.append(_row(f"**auto pick** ({cand}, {rt})", pairs.get(f"{cand}/{rt}"), base, cand, rt))
    check = Check(**r["check"])
    lines += ["", claim(check, "The auto pick is the fastest in-budget pair"), ""]
    phases = r["phase_seconds"] or {}
    if phases:
        top = sorted(phases.items(), key=lambda kv: -kv[1])[:8]
        lines += [
            "Where the run's time went (seconds): "
            + ", ".join(f"{k} {v:.0f}" for k, v in top)
            + ".",
            "",
        ]
    return lines


def _model_doc(r: dict[str, Any]) -> dict[str, Any]:
    """What the results section shows of one model's run, from its manifest."""
    m = r["manifest"]
    pick = m.get("runtime_pick") or {}
    wanted = [(c, rt) for _, c, rt in ROWS] + [(pick.get("candidate", ""), pick.get("runtime", ""))]
    return {
        "model": r["model"],
        "wall_s": r["wall_s"],
        "threads": m["recipe"]["target"]["threads"],
        "conditions": m.get("measurement_conditions"),
        "phase_seconds": m.get("phase_seconds"),
        "runtime_pick": m.get("runtime_pick"),
        "runtimes": m.get("runtimes"),
        "pairs": {f"{c}/{rt}": f for c, rt in wanted if (f := _figures(m, c, rt)) is not None},
        "check": r["check"].to_dict(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--models", nargs="+", default=["mnist", "minilm"])
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--work", type=Path, default=Path("/tmp/slimline-bench-runtimes"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--reuse", nargs="*", default=[], help="models whose earlier cached results to reuse"
    )
    p.add_argument(
        "--rerender", action="store_true", help="write the table from the runs left in --work"
    )
    args = p.parse_args(argv)
    before = busy_cores(1.0)
    results = []
    for model in args.models:
        r = run_model(model, args.rounds, args.work, args.rerender, model in args.reuse)
        r["check"] = _pick_check(r["manifest"])
        results.append(r)
    cpu = detect()
    doc = {
        "command": reproduce_command(
            "runtimes.py", _footer_argv(sys.argv[1:] if argv is None else argv)
        ),
        "cpu": {"kind": cpu.kind, "features": sorted(cpu.features)},
        "cores": os.cpu_count(),
        "busy_cores": {"before": before, "after": busy_cores(1.0)},
        "models": [_model_doc(r) for r in results],
    }
    publish(render(doc), doc, args.out, "runtimes.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
