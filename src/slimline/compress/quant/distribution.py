"""Distribution analysis: per-tensor statistics of weights and activations, and the calibration
method they call for (heavy outliers waste MinMax's range: Percentile clips them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from .calibrate import Calibration

__all__ = ["analyse", "recommend_calibration", "weight_stats"]

HEAVY_RANGE_RATIO = 4.0  # max |x| at least this many times the 99.99th percentile of |x|
HEAVY_OUTLIER_SHARE = 1e-3  # share of values beyond 6 standard deviations
HEAVY_TENSOR_SHARE = 0.1  # share of activation tensors with heavy outliers that flips the choice
_TOP = 8


def _describe(w: np.ndarray) -> dict[str, float]:
    a = w.astype(np.float64).ravel()
    absmax = float(np.abs(a).max()) if a.size else 0.0
    p = np.percentile(a, [0.01, 1, 50, 99, 99.99]) if a.size else np.zeros(5)
    p_abs = float(np.percentile(np.abs(a), 99.99)) if a.size else 0.0
    mean, std = float(a.mean()), float(a.std())
    return {
        "min": float(a.min()),
        "max": float(a.max()),
        "mean": mean,
        "std": std,
        "p0_01": float(p[0]),
        "p1": float(p[1]),
        "p50": float(p[2]),
        "p99": float(p[3]),
        "p99_99": float(p[4]),
        "range_ratio": absmax / p_abs if p_abs > 0 else 1.0,
        "outlier_share": float((np.abs(a - mean) > 6 * max(std, 1e-12)).mean()),
        "count": float(a.size),
    }


def weight_stats(model: Path, nodes: list[str]) -> dict[str, dict[str, float]]:
    """Statistics of the weight (second input) of each named compute node."""
    m = onnx.load(str(model))
    inits = {i.name: i for i in m.graph.initializer}
    wanted = set(nodes)
    out: dict[str, dict[str, float]] = {}
    for n in m.graph.node:
        if n.name in wanted and len(n.input) > 1 and n.input[1] in inits:
            out[n.input[1]] = _describe(numpy_helper.to_array(inits[n.input[1]]))
    return out


def _heavy(s: dict[str, float]) -> bool:
    return s["range_ratio"] >= HEAVY_RANGE_RATIO or s["outlier_share"] > HEAVY_OUTLIER_SHARE


def recommend_calibration(activations: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Percentile when a sizeable share of activation tensors has heavy outliers, else MinMax."""
    if not activations:
        return {"method": "minmax", "reason": "no activation statistics"}
    heavy = sorted(
        (k for k, s in activations.items() if _heavy(s)),
        key=lambda k: -activations[k]["range_ratio"],
    )
    share = len(heavy) / len(activations)
    if share >= HEAVY_TENSOR_SHARE:
        worst = activations[heavy[0]]
        return {
            "method": "percentile",
            "heavy_tensors": len(heavy),
            "reason": (
                f"{len(heavy)} of {len(activations)} activation tensors have heavy outliers (max |x| "
                f">= {HEAVY_RANGE_RATIO:g}x the 99.99th percentile, or > {HEAVY_OUTLIER_SHARE:.1%} "
                f"beyond 6 sigma); worst {heavy[0]} at {worst['range_ratio']:.1f}x: MinMax would "
                "spend most of the INT8 range on them, Percentile clips them"
            ),
        }
    return {
        "method": "minmax",
        "heavy_tensors": len(heavy),
        "reason": f"only {len(heavy)} of {len(activations)} activation tensors have heavy outliers; MinMax keeps every value in range",
    }


def analyse(calib: Calibration, weights: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Summary for the record: worst tensors, the recommendation, and histograms to plot."""
    acts = calib.stats
    top = sorted(acts, key=lambda k: (-acts[k]["outlier_share"], -acts[k]["range_ratio"]))[:_TOP]
    top_w = sorted(weights, key=lambda k: -weights[k]["range_ratio"])[:_TOP]
    return {
        "recommendation": recommend_calibration(acts),
        "activation_tensors": len(acts),
        "weight_tensors": len(weights),
        "activations_top": {k: _rounded(acts[k]) for k in top},
        "weights_top": {k: _rounded(weights[k]) for k in top_w},
        "histograms": {k: calib.histograms[k] for k in top if k in calib.histograms},
        "heavy_weights": sum(_heavy(s) for s in weights.values()),
    }


def _rounded(s: dict[str, float]) -> dict[str, float]:
    return {k: float(f"{v:.5g}") for k, v in s.items()}
