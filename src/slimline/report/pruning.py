"""Report sections for structured pruning: what was removed, the sensitivity heatmap, the plan,
the recovery rounds, and the four-way table {FP32, optimized} x {PyTorch, ONNX Runtime}."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np

from ..records import PruneRecord, prune_record
from . import section
from .html import fmt, ratio_to_base, table
from .plots import figure, png_img

__all__ = ["four_way", "pruning"]


def _prune_candidates(m: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        c
        for c in m.get("candidates", [])
        if c.get("step") == "prune" and not c.get("alternative") and c.get("meta", {}).get("macs")
    ]


def _short(name: str, keep: int = 34) -> str:
    return name if len(name) <= keep else "…" + name[-(keep - 1) :]


def _facts(c: dict[str, Any]) -> str:
    meta = prune_record(c["meta"])
    macs, params, planned = meta["macs"], meta["params"], meta.get("planned") or {}
    sweep = meta.get("sensitivity") or {}
    rows = [
        ["MACs (batch 1)", f"{macs['before']:,} → {macs['after']:,} (−{macs['removed']:.1%})"],
        ["parameters", f"{params['before']:,} → {params['after']:,} (−{params['removed']:.1%})"],
        [
            "target",
            f"{fmt(planned.get('target'), 2)} of {planned.get('by', '-')}"
            if planned.get("target")
            else "plan given in the recipe",
        ],
        ["predicted loss", fmt(planned.get("predicted_loss"), 4)],
        ["importance", html.escape(", ".join(meta.get("importance") or []) or "-")],
        ["fine-tuning data", html.escape(str(meta.get("finetune_data")))],
        [
            "rounds",
            f"{len(meta.get('rounds', []))} (resumed after round {meta.get('resumed_after_round', 0)})",
        ],
        [
            "sensitivity sweep",
            f"{sweep.get('jobs', '-')} jobs, {sweep.get('seconds', '-')} s, "
            f"{html.escape(str(sweep.get('backend', '-')))}, {sweep.get('samples', '-')} samples"
            f"{' (reused from the cache)' if sweep.get('reused') else ''}"
            if sweep
            else "skipped (plan given)",
        ],
        [
            "decision",
            f"{'kept' if c.get('accepted') else 'rejected'}: {html.escape(c.get('reason') or '')}",
        ],
    ]
    skipped = meta.get("skipped_groups") or {}
    if skipped:
        rows.append(
            ["not prunable", html.escape("; ".join(f"{k}: {v}" for k, v in skipped.items()))]
        )
    return table(["", ""], rows)


def _heatmap(meta: PruneRecord) -> str | None:
    sweep = meta.get("sensitivity")
    if not sweep or not sweep.get("groups"):
        return None
    names = list(sweep["groups"])
    ratios = sweep["ratios"]
    base = sweep["base_metric"]
    drop = np.array([[base - v for v in sweep["groups"][n]["metric"]] for n in names]) * 100.0
    fig, ax = figure(7.5, 0.9 + 0.32 * len(names))
    im = ax.imshow(drop, aspect="auto", cmap="Reds", vmin=0.0, vmax=max(1.0, float(drop.max())))
    ax.set_xticks(range(len(ratios)), [f"{r:.0%}" for r in ratios])
    ax.set_yticks(range(len(names)), [_short(n) for n in names], fontsize=7)
    ax.set_xlabel("share of the group's channels (or heads) removed, alone, before fine-tuning")
    plan = meta.get("plan") or {}
    for i, n in enumerate(names):
        for j, r in enumerate(ratios):
            ax.text(j, i, f"{round(drop[i, j], 1) + 0.0:.1f}", ha="center", va="center", fontsize=6)
            if abs(plan.get(n, -1.0) - r) < 1e-9:
                ax.add_patch(_box(j, i))
    fig.colorbar(im, ax=ax, label="metric drop (points)")
    return png_img(fig, "sensitivity heatmap: metric drop per group and ratio; boxes mark the plan")


def _box(x: int, y: int) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.5)


def _plan_table(meta: PruneRecord) -> str:
    plan = meta.get("plan") or {}
    rows = [
        [
            html.escape(n),
            g["kind"],
            g["size"],
            g["kept"],
            f"{plan.get(n, 0.0):.0%}",
            f"{1 - g['kept'] / g['size']:.0%}",
        ]
        for n, g in meta.get("groups", {}).items()
    ]
    return table(["group", "kind", "size", "kept", "planned ratio", "removed"], rows)


def _rounds_table(meta: PruneRecord) -> str:
    rows = []
    for r in meta.get("rounds", []):
        if "skipped" in r:
            rows.append([r["round"], html.escape(r["skipped"]), "", "", "", "", ""])
            continue
        ft = r.get("finetune") or {}
        removed = sum(r.get("removed_units", {}).values())
        early = " (early stop)" if ft.get("stopped_early") else ""
        rows.append(
            [
                r["round"],
                removed,
                f"{r['macs']:,}",
                fmt(r["metric"], 4),
                fmt(r["cosine_mean"], 4),
                f"{ft.get('steps', 0)}{early}: {fmt(ft.get('val_before'), 4)} → {fmt(ft.get('val_after'), 4)}",
                fmt(r.get("seconds"), 1),
            ]
        )
    return table(
        ["round", "units removed", "MACs", "metric", "cosine", "fine-tune steps: loss", "s"], rows
    )


@section(200, "Structured pruning")
def pruning(m: dict[str, Any], run_dir: Path) -> str | None:
    cands = _prune_candidates(m)
    if not cands:
        return None
    parts = []
    for c in cands:
        meta = prune_record(c["meta"])
        parts.append(f"<h3>{html.escape(c['name'])}</h3>" + _facts(c))
        heat = _heatmap(meta)
        if heat:
            parts.append(
                "<p>Sensitivity map: each group pruned alone; the plan is boxed.</p>" + heat
            )
        parts.append(
            "<p>Plan (copy <code>plan</code> from the manifest into the recipe to edit "
            "and rerun it):</p>" + _plan_table(meta)
        )
        parts.append(
            "<p>Rounds of pruning, each recovered by distillation:</p>" + _rounds_table(meta)
        )
    return "".join(parts)


def _row(
    label: str, runtime: str, metric: Any, fid: dict[str, Any], p50: Any, ratio: Any
) -> list[Any]:
    return [
        label,
        runtime,
        fmt(metric, 4),
        fmt(fid.get("cosine_mean"), 4),
        fmt(fid.get("top1_agreement"), 4),
        fmt(p50, 3),
        ratio,
    ]


def _label(c: dict[str, Any]) -> str:
    kept = "" if c.get("accepted") else ", rejected"
    return f"optimized ({html.escape(c['name'])}{kept})"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _measured(c: dict[str, Any]) -> tuple[Any, dict[str, Any], Any]:
    return (
        (c.get("metric") or {}).get("value"),
        c.get("fidelity") or {},
        (c.get("latency_ms") or {}).get("p50"),
    )


@section(210, "FP32 vs optimized: PyTorch and ONNX Runtime")
def four_way(m: dict[str, Any], run_dir: Path) -> str | None:
    cands = {c["name"]: c for c in m.get("candidates", []) if not c.get("alternative")}
    pruned = [c for c in _prune_candidates(m) if c["meta"].get("torch")]
    if not pruned or "fp32-torch" not in cands or "fp32-onnx" not in cands:
        return None
    torch_view = prune_record(pruned[-1]["meta"]).get("torch") or {}
    selected = cands.get(m.get("selected") or "", cands["fp32-onnx"])
    ft, fo, so = _measured(cands["fp32-torch"]), _measured(cands["fp32-onnx"]), _measured(selected)
    t_p50, t_base = torch_view["latency_ms"]["p50"], torch_view["fp32_latency_ms"]["p50"]
    rows = [
        _row("FP32", "PyTorch", *ft, "1.00x"),
        _row("FP32", "ONNX Runtime", *fo, "1.00x"),
        _row(
            _label(pruned[-1]),
            "PyTorch",
            torch_view["metric"],
            torch_view["fidelity"],
            t_p50,
            f"{t_p50 / t_base:.2f}x",
        ),
        _row(
            _label(selected),
            "ONNX Runtime",
            *so,
            _times(
                ratio_to_base(
                    selected.get("latency_ms") or {}, cands["fp32-onnx"].get("latency_ms")
                )
            ),
        ),
    ]
    note = (
        "<p>Latency p50 at batch 1. Ratios are against FP32 on the same runtime, measured "
        "interleaved in one session (the PyTorch pair during the prune step, the ONNX Runtime "
        "candidates in the final benchmark, as the median of the per-round ratios).</p>"
    )
    return (
        table(
            ["model", "runtime", "metric", "cosine", "top-1 agreement", "p50 ms", "vs FP32"], rows
        )
        + note
    )
