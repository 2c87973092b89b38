"""Benchmark: structured pruning + INT8 on the built-in examples, against the issue's targets.

For each example it runs the built-in recipe ``<example>-prune`` (export -> prune -> graph ->
quantize) end to end with a fresh step cache, so every step really runs; the example's trained
weights are loaded (or trained) before the clock starts. All latency ratios come from the run's
final benchmark, where every candidate is measured interleaved (A B C A B C ...) at batch 1 on
the recipe's threads, against FP32 ONNX Runtime in the same session.

Reproduce (the machine should be otherwise idle; ``nice`` keeps it polite when it is not):

    nice -n 10 .venv/bin/python bench/prune_bench.py --examples mnist minilm --out bench/RESULTS-prune.md
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_out import NOT_MEASURED, figure, publish, reproduce_command, reproduce_footer

TARGETS: dict[str, dict[str, float]] = {
    # ratios are against FP32 ONNX Runtime, batch 1, interleaved in one run
    "mnist": {
        "macs_removed_min": 0.30,
        "prune_drop_max": 0.005,
        "int8_ratio_max": 0.30,
        "int8_drop_max": 0.01,
        "wall_s_max": 600.0,
    },
    "minilm": {
        "int8_ratio_max": 0.35,
        "cosine_min": 0.95,
        "int8_drop_max": 0.02,
        "metric_within": True,
    },
}


def _run(
    example: str, threads: int | None, keep_runs: Path, cache: Path | None, remeasure: bool = False
) -> tuple[dict[str, Any], float]:
    from slimline.commands import resolve_recipe
    from slimline.pipeline import run_recipe
    from slimline.task import load_task

    recipe = resolve_recipe(f"{example}-prune")
    if threads:
        recipe = recipe.model_copy(
            update={"target": recipe.target.model_copy(update={"threads": threads})}
        )
    task = load_task(recipe.task)
    assert task.model is not None
    task.model()  # trained weights come from the example cache; not part of the recipe's time
    out = keep_runs / f"{example}-prune-{time.strftime('%Y%m%d-%H%M%S')}"
    with tempfile.TemporaryDirectory(prefix="slimline-bench-cache-") as fresh:
        t0 = time.perf_counter()
        run_recipe(recipe, out, cache=cache or Path(fresh), remeasure=remeasure)
        wall = time.perf_counter() - t0
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["_run_dir"] = str(out)
    return manifest, wall


def _figures(m: dict[str, Any], wall: float) -> dict[str, Any]:
    cands = {c["name"]: c for c in m["candidates"] if not c.get("alternative")}
    base = cands["fp32-onnx"]["latency_ms"]["p50"]
    ref = m["reference_metric"]
    prune, graph, quant = cands.get("prune"), cands.get("graph"), cands.get("quantize")
    base_rounds = cands["fp32-onnx"]["latency_ms"].get("per_round_p50")

    def ancestors(c: dict[str, Any]) -> list[str]:
        out: list[str] = []
        parent = c.get("parent")
        while isinstance(parent, str) and parent in cands:
            out.append(parent)
            parent = cands[parent].get("parent")
        return out

    def fig(c: dict[str, Any] | None) -> dict[str, Any] | None:
        if c is None:
            return None
        rounds = c["latency_ms"].get("per_round_p50")
        paired = (
            [r / b for r, b in zip(rounds, base_rounds, strict=True)]
            if rounds and base_rounds
            else None
        )
        return {
            "p50_ms": c["latency_ms"]["p50"],
            "ratio": c["latency_ms"]["p50"] / base,
            "round_ratios": paired,
            # the estimator for an interleaved run on a drifting machine: each round's ratio
            # compares two measurements minutes apart, the ratio of medians compares any two
            "paired_ratio": float(statistics.median(paired)) if paired else None,
            "ancestors": ancestors(c),
            "metric": c["metric"]["value"],
            "drop": ref - c["metric"]["value"],
            "cosine": c["fidelity"]["cosine_mean"],
            "accepted": c["accepted"],
            "parent": c["parent"],
            "reason": c["reason"],
        }

    meta = (prune or {}).get("meta", {})
    return {
        "metric_name": m["task"]["metric_name"],
        "fp32_metric": ref,
        "fp32_p50_ms": base,
        "macs_removed": (meta.get("macs") or {}).get("removed"),
        "params_removed": (meta.get("params") or {}).get("removed"),
        "plan": meta.get("plan"),
        "sweep_reused": bool((meta.get("sensitivity") or {}).get("reused")),
        "prune": fig(prune),
        "graph": fig(graph),
        "int8": fig(quant),
        "wall_s": wall,
        "run_dir": m["_run_dir"],
        "created": m.get("created", "-"),
        "recipe": m["recipe"]["name"],
        "hardware": m["hardware"],
    }


def _checks(example: str, f: dict[str, Any]) -> list[tuple[str, bool | None]]:
    """Each target with whether the run met it; ``None`` where the run did not measure the
    figure the target is about (no pruned candidate, or INT8 built on FP32, not on it)."""
    t, p, q = TARGETS[example], f["prune"], f["int8"]
    out: list[tuple[str, bool | None]] = []
    if "macs_removed_min" in t:
        macs = f["macs_removed"]
        out.append(
            (
                f"MACs removed >= {t['macs_removed_min']:.0%}",
                None if macs is None else macs >= t["macs_removed_min"],
            )
        )
    if "prune_drop_max" in t:
        out.append(
            (
                f"pruned drop <= {t['prune_drop_max'] * 100:.1f} pt",
                None if p is None else p["drop"] <= t["prune_drop_max"],
            )
        )
    # the pruned+INT8 targets are about INT8 on the pruned model: when pruning was rejected
    # the INT8 candidate is built on FP32, and its figures answer a different question
    on_pruned = q is not None and "prune" in q["ancestors"]
    out.append(("INT8 built on the pruned model", None if q is None else on_pruned))
    int8 = q if on_pruned else None
    out.append(
        (
            f"pruned+INT8 latency <= {t['int8_ratio_max']:.2f}x (median per-round ratio)",
            None if int8 is None else _headline_ratio(int8) <= t["int8_ratio_max"],
        )
    )
    if t.get("metric_within"):  # "within 0.02 of FP32": a rise counts as much as a drop
        out.append(
            (
                f"pruned+INT8 {f['metric_name']} within {t['int8_drop_max']:.2f} of FP32",
                None if int8 is None else abs(int8["drop"]) <= t["int8_drop_max"],
            )
        )
    else:
        out.append(
            (
                f"pruned+INT8 drop <= {t['int8_drop_max']:.2f}",
                None if int8 is None else int8["drop"] <= t["int8_drop_max"],
            )
        )
    if "cosine_min" in t:
        out.append(
            (
                f"pruned+INT8 cosine >= {t['cosine_min']}",
                None if int8 is None else int8["cosine"] >= t["cosine_min"],
            )
        )
    if "wall_s_max" in t:
        out.append(
            (f"recipe wall time < {t['wall_s_max'] / 60:.0f} min", f["wall_s"] < t["wall_s_max"])
        )
    return out


def _met(ok: bool | None) -> str:
    return NOT_MEASURED if ok is None else "yes" if ok else "**no**"


def _headline_ratio(c: dict[str, Any]) -> float:
    return float(c["paired_ratio"] if c.get("paired_ratio") is not None else c["ratio"])


def _lineage(step: str, c: dict[str, Any] | None) -> str:
    """``pruned + INT8`` when the candidate descends from the pruned model, plain ``INT8`` when
    pruning was rejected (the row names the parent it was built on)."""
    return f"pruned + {step}" if c is None or "prune" in c["ancestors"] else step


def _row(name: str, c: dict[str, Any] | None, metric_name: str) -> str:
    if c is None:
        return f"| {name} | {NOT_MEASURED} (no such candidate in the run) | - | - | - | - | - |"
    state = "kept" if c["accepted"] else "rejected"
    rr = c["round_ratios"]
    rounds = f"{_headline_ratio(c):.2f}x ({min(rr):.2f}-{max(rr):.2f})" if rr else "-"
    return (
        f"| {name} ({state}, on {c['parent']}) | {c['p50_ms']:.3f} | {c['ratio']:.2f}x | "
        f"{rounds} | {c['metric']:.4f} | {c['drop'] * 100:+.2f} pt | {c['cosine']:.4f} |"
    )


def _section(example: str, f: dict[str, Any], cmd: str) -> str:
    hw = f["hardware"]
    lines = [
        f"## {example}: prune -> graph -> INT8 (`{f['recipe']}`)",
        "",
        f"{hw.get('cpu')} x{hw.get('cores')}, manifest written {f['created']}; "
        f"run directory `{f['run_dir']}`; recipe wall time {f['wall_s']:.0f} s ({f['cache']}"
        f"{'; sensitivity map reused from an earlier run' if f['sweep_reused'] else ''}).",
        "",
        f"MACs removed {figure(f['macs_removed'], '.1%')}, parameters removed "
        f"{figure(f['params_removed'], '.1%')}.",
        "",
        f"| candidate | p50 ms (batch 1) | p50 / FP32 p50 | per-round ratio: median (range) | {f['metric_name']} "
        "| drop | cosine |",
        "|---|---|---|---|---|---|---|",
        f"| FP32 ONNX Runtime | {f['fp32_p50_ms']:.3f} | 1.00x | 1.00x (1.00-1.00) | {f['fp32_metric']:.4f} "
        "| 0 | 1.0000 |",
        _row("pruned", f["prune"], f["metric_name"]),
        _row(_lineage("graph fusion", f["graph"]), f["graph"], f["metric_name"]),
        _row(_lineage("INT8", f["int8"]), f["int8"], f["metric_name"]),
        "",
        "| target | met |",
        "|---|---|",
        *[f"| {name} | {_met(ok)} |" for name, ok in _checks(example, f)],
        "",
    ]
    for step in ("prune", "graph", "int8"):
        c = f[step]
        if c:
            lines += [f"- {step}: {'kept' if c['accepted'] else 'rejected'}: {c['reason']}"]
    lines += [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--examples", nargs="+", default=["mnist", "minilm"], choices=sorted(TARGETS)
    )
    parser.add_argument("--threads", type=int, default=None, help="override the recipes' threads")
    parser.add_argument("--out", type=Path, default=Path("bench/RESULTS-prune.md"))
    parser.add_argument("--runs", type=Path, default=Path("runs"), help="where run directories go")
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="step cache (default: a fresh temporary one, so every step runs and is timed); a "
        "kept one lets a killed run resume from its last finished pruning round",
    )
    parser.add_argument(
        "--remeasure",
        action="store_true",
        help="with --cache: reuse the cached steps but judge and time them again",
    )
    parser.add_argument(
        "--from-run",
        type=Path,
        nargs="+",
        default=None,
        help="render finished run directories (one per example, in --examples order) instead "
        "of running; the wall time is the manifest's",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )  # step times
    cmd = "nice -n 10 " + reproduce_command("prune_bench.py", argv)
    doc: dict[str, Any] = {"command": cmd, "python": platform.python_version(), "examples": {}}
    if args.from_run and len(args.from_run) != len(args.examples):
        parser.error("--from-run takes one run directory per example")
    for i, example in enumerate(args.examples):
        if args.from_run:
            manifest = json.loads((args.from_run[i] / "manifest.json").read_text())
            manifest["_run_dir"] = str(args.from_run[i])
            wall = float(manifest["wall_seconds"])
        else:
            manifest, wall = _run(example, args.threads, args.runs, args.cache, args.remeasure)
        figures = _figures(manifest, wall)
        figures["cache"] = (
            "rendered from the run's manifest"
            if args.from_run
            else f"step cache {args.cache}"
            if args.cache
            else "cold step cache"
        )
        doc["examples"][example] = {
            **figures,
            "targets": {name: ok for name, ok in _checks(example, figures)},
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    publish(render(doc), doc, args.out, "prune_bench.py")
    return 0


def render(doc: dict[str, Any]) -> str:
    """The results section, from the JSON alone."""
    parts = [
        "# Structured pruning benchmark",
        "",
        f"python {doc['python']}; every figure from one recipe run per example.",
        "",
        *(_section(example, f, doc["command"]) for example, f in doc["examples"].items()),
    ]
    return "\n".join([*parts, *reproduce_footer(doc["command"])])


if __name__ == "__main__":
    sys.exit(main())
