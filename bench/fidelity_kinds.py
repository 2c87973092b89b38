"""Zoo models judged by what their task sees: each model's recipe (bench/zoo.py: graph +
quantize, its real inputs) with its outputs declared by kind, through ``slimline optimize``.
For every candidate the manifest holds the declared agreement (which the budget judged) and the
cosine beside it, so the table shows both verdicts: the cosine-only judge's and the declared
one's.

    nice -n 5 .venv/bin/python bench/fidelity_kinds.py --out bench/RESULTS-fidelity-kinds.md
    .venv/bin/python bench/fidelity_kinds.py --only ppocr-rec
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

import zoo
from bench_out import publish, reproduce_command, reproduce_footer

HERE = Path(__file__).resolve().parent
DECODE = f"{HERE / 'fidelity_decode.py'}:ddddocr_yolox"
HOOK = f"{HERE / 'fidelity_hooks.py'}:ppocr_cls_top1"

# model -> (declaration, why this kind); thresholds as each package's own post-processing
DECLARED: dict[str, tuple[dict[str, Any], str]] = {
    "ppocr-cls": (
        {"save_infer_model/scale_0.tmp_1": {"kind": "logits"}},
        "text direction, 2 classes; with a metric hook (bench/fidelity_hooks.py) on the true "
        "labels: each crop upright (class '0') and turned 180 degrees (class '180')",
    ),
    "ppocr-det": (
        {"sigmoid_0.tmp_0": {"kind": "probability_map", "threshold": 0.3}},
        "DBNet text map; RapidOCR binarizes it at 0.3 (config.yaml `thresh`)",
    ),
    "ppocr-rec": (
        {"softmax_11.tmp_0": {"kind": "ctc", "blank": 0}},
        "CTC over 6,625 characters, blank 0 (RapidOCR's CTCLabelDecode)",
    ),
    "ddddocr-ocr": (
        {"387": {"kind": "ctc", "blank": 0}},
        "CTC over ddddocr's charset, blank 0",
    ),
    "ddddocr-det": (
        {"output": {"kind": "boxes", "decode": DECODE}},
        "YOLOX boxes, decoded as ddddocr does (score 0.1, NMS 0.45): bench/fidelity_decode.py",
    ),
}


def _ppocr_cls_labels(evaluation: Path) -> str:
    """Labels of the classifier's evaluation rows (bench/zoo_inputs.py stacks each crop upright,
    then turned): 0, 1, 0, 1, ...; written into the evaluation file; returns the hook."""
    with np.load(evaluation) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["labels"] = np.arange(len(arrays["x"])) % 2
    np.savez(evaluation, **arrays)
    return HOOK


LABELLED = {"ppocr-cls": _ppocr_cls_labels}


def run_model(name: str, work: Path, limit_s: float, quick: bool) -> dict[str, Any]:
    m = zoo.BY_NAME[name]
    if work.exists():  # a cold step cache, as bench/zoo.py runs each model
        shutil.rmtree(work)
    rec_path = zoo.prepare(m, work, quick=quick)
    rec = yaml.safe_load(rec_path.read_text())
    decl, why = DECLARED[name]
    rec["outputs"] = decl
    rec["budget"]["min_agreement"] = 0.99
    if name in LABELLED:
        rec["metric"] = LABELLED[name](work / "evaluation.npz")
    rec_path.write_text(yaml.safe_dump(rec, sort_keys=False))
    rc, wall = zoo.run_optimize(rec_path, work, limit_s)
    out: dict[str, Any] = {
        "model": name,
        "declared": decl,
        "why": why,
        "exit": rc,
        "wall_s": round(wall, 1),
    }
    manifest = work / "run" / "manifest.json"
    if manifest.is_file():
        out.update(candidates(json.loads(manifest.read_text())))
    else:
        out["log_tail"] = (work / "log.txt").read_text(errors="replace").splitlines()[-8:]
    return out


def candidates(m: dict[str, Any]) -> dict[str, Any]:
    """Every candidate with a fidelity record: cosine, declared agreement and figures, verdict."""
    rows = []
    base = m["recipe"]["budget"]
    for c in m["candidates"]:
        fid = c.get("fidelity") or {}
        if "cosine_mean" not in fid:
            continue
        declared: dict[str, Any] = next(iter((fid.get("declared") or {}).values()), {})
        rows.append(
            {
                "name": c["name"],
                "accepted": bool(c.get("accepted")),
                "cosine": fid["cosine_mean"],
                "agreement": fid.get("agreement"),
                "figures": {
                    **{k: v for k, v in declared.items() if k not in ("kind", "cosine_mean")},
                    **_task_metric(c),
                    **({"measured on": fid["rows"]} if fid.get("rows") else {}),
                },
                "cosine_verdict": fid["cosine_mean"] >= base["min_cosine"],
                "reason": c.get("reason") or "",
                "p50_ratio": _ratio(c, m),
            }
        )
    return {
        "status": m["status"],
        "selected": m.get("selected"),
        "candidates": rows,
        "quantize_search": search_record(m),
        "run_wall_s": m.get("wall_seconds"),
    }


def _task_metric(c: dict[str, Any]) -> dict[str, Any]:
    """A metric hook's value (an ONNX task's own metric is its cosine: not repeated)."""
    metric = c.get("metric") or {}
    name = metric.get("name")
    return {name: metric.get("value")} if name and name != "fidelity" else {}


def search_record(m: dict[str, Any]) -> dict[str, Any] | None:
    """The quantize step's wall time, where it went, how many trials were screened on a subset
    of the rows, and why its search stopped."""
    q = next((c for c in m["candidates"] if c["name"] == "quantize"), None)
    meta = (q or {}).get("meta") or {}
    search = meta.get("search") or {}
    if not search:
        return None
    trials = search.get("candidates") or []
    return {
        "step_wall_s": meta.get("step_wall_s"),
        "timings_s": meta.get("timings_s"),
        "trials": len(trials),
        "screened": sum(1 for t in trials if t.get("screened")),
        "stopped": search.get("stopped"),
    }


def _ratio(c: dict[str, Any], m: dict[str, Any]) -> float | None:
    """p50 over FP32's: the final benchmark's, or for an alternative its search's."""
    base = next((x for x in m["candidates"] if x["name"] == "fp32-onnx"), None)
    p, b = (c.get("latency_ms") or {}).get("p50"), ((base or {}).get("latency_ms") or {}).get("p50")
    if p and b:
        return round(float(p) / float(b), 3)
    ratio = (c.get("meta") or {}).get("latency_ratio_vs_fp32")
    return round(float(ratio), 3) if ratio else None


def rendered(name: str, work: Path) -> dict[str, Any]:
    """A model's result from its work folder, without running it again."""
    decl, why = DECLARED[name]
    manifest = json.loads((work / "run" / "manifest.json").read_text())
    out: dict[str, Any] = {"model": name, "declared": decl, "why": why, "exit": 0}
    out.update(candidates(manifest))
    out["wall_s"] = out["run_wall_s"]
    return out


def _figures(f: dict[str, Any]) -> str:
    keep = (
        "iou_mean",
        "iou_min",
        "cer",
        "exact_rows",
        "recall",
        "precision",
        "boxes_fp32",
        "boxes",
        "ppocr_cls_top1",
        "measured on",
    )
    return ", ".join(
        f"{k} {f[k]:.4f}" if isinstance(f[k], float) else f"{k} {f[k]}" for k in keep if k in f
    )


def render(doc: dict[str, Any]) -> str:
    """The generated section, from the JSON alone."""
    results, cmd = doc["models"], doc["command"]
    recipe = (
        "bench/zoo.py's quick recipe (quantize only, 2 x 100 timed runs, no peak RSS)"
        if doc["quick"]
        else "bench/zoo.py's graph + quantize"
    )
    lines = [
        "## Fidelity by output kind on zoo models",
        "",
        f"{doc['date']}, CPU: {doc['cpu']}, "
        f"{doc['threads']} threads, recipe: {recipe} on the model's real inputs, with the output "
        "declared by kind and `budget: {min_agreement: 0.99, min_cosine: 0.99}`. 'cosine judge' is the verdict the old rule (mean cosine >= 0.99) "
        "gives the same candidate; 'agreement' is what the budget judged.",
        "",
        "| model | declared | candidate | cosine | cosine judge | agreement | figures | kept | "
        "x FP32 p50 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        decl = ", ".join(f"`{k}`: {v['kind']}" for k, v in r["declared"].items())
        if not r.get("candidates"):
            lines.append(f"| {r['model']} | {decl} | exit {r['exit']} | | | | | | |")
            continue
        for c in r["candidates"]:
            agree = f"{c['agreement']:.4f}" if c["agreement"] is not None else "-"
            lines.append(
                f"| {r['model']} | {decl} | {c['name']} | {c['cosine']:.4f} | "
                f"{'within' if c['cosine_verdict'] else 'over'} | {agree} | "
                f"{_figures(c['figures'])} | {'yes' if c['accepted'] else 'no'} | "
                f"{c['p50_ratio'] if c['p50_ratio'] is not None else '-'} |"
            )
    lines += ["", *disagreements(results)]
    lines += ["", "The quantize step's search (item 4 of issue 27):", ""]
    for r in results:
        q = r.get("quantize_search")
        if q:
            lines.append(
                f"- {r['model']}: quantize step {q['step_wall_s']} s, {q['trials']} trials, "
                f"{q['screened']} rejected on a subset of the rows; stopped: {q['stopped']}; "
                f"time by phase (s): {q['timings_s']}"
            )
    lines += ["", "Why each declaration:", ""]
    lines += [
        f"- {r['model']}: {r['why']}; selected {r.get('selected')}, {r['wall_s']} s"
        for r in results
    ]
    return "\n".join(lines + reproduce_footer(cmd))


def disagreements(results: list[dict[str, Any]]) -> list[str]:
    """The candidates the cosine judge and the declared judge give different verdicts."""
    rows = [
        (r["model"], c)
        for r in results
        for c in r.get("candidates") or []
        if c["agreement"] is not None and c["cosine_verdict"] != (c["agreement"] >= 0.99)
    ]
    total = sum(len(r.get("candidates") or []) for r in results)
    out = [f"The two judges disagree on {len(rows)} of {total} candidates:", ""]
    for model, c in rows:
        side = "within" if c["cosine_verdict"] else "over"
        out.append(
            f"- {model} {c['name']}: cosine {c['cosine']:.4f} ({side} 0.99 by cosine), "
            f"agreement {c['agreement']:.4f} ({_figures(c['figures'])})"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=sorted(DECLARED))
    ap.add_argument("--work", type=Path, default=HERE / "out" / "fidelity-kinds")
    ap.add_argument("--limit", type=float, default=zoo.TIME_LIMIT_S, help="seconds per model")
    ap.add_argument("--out", type=Path, help="write the markdown here (and .json beside)")
    ap.add_argument("--quick", action="store_true", help="bench/zoo.py's quick recipe")
    ap.add_argument(
        "--render", action="store_true", help="run nothing: the table from the work folders"
    )
    args = ap.parse_args(argv)
    results = []
    for name in args.only or list(DECLARED):
        if args.render:
            results.append(rendered(name, args.work / name))
            continue
        print(f"fidelity-kinds: {name} ...", file=sys.stderr, flush=True)
        results.append(run_model(name, args.work / name, args.limit, args.quick))
        print(f"fidelity-kinds: {name}: exit {results[-1]['exit']}", file=sys.stderr, flush=True)
    given = sys.argv[1:] if argv is None else argv
    cmd = reproduce_command("fidelity_kinds.py", [a for a in given if a != "--render"])
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": zoo.cpu_kind(),
        "threads": zoo.THREADS,
        "command": cmd,
        "quick": args.quick,
        "models": results,
    }
    publish(render(doc), doc, args.out, "fidelity_kinds.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
