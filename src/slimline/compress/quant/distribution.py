"""Distribution analysis for quantization: statistics of the weights of the quantized nodes and
of the activations seen during calibration, and the calibration method they call for.

The statistics and the rule (heavy tails -> Percentile) are the project's shared ones in
:mod:`slimline.measure.distributions`; activation statistics come from the calibration pass
(exact range, moments and histogram percentiles of a fixed-stride subsample).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
from onnx import numpy_helper

from ...measure.distributions import is_heavy, recommend_calibration, tensor_stats
from .calibrate import Calibration

__all__ = ["activation_stats", "analyse", "weight_stats"]

_TOP = 8


def weight_stats(model: Path, nodes: list[str]) -> dict[str, dict[str, float]]:
    """Statistics of the weight (second input) of each named compute node."""
    m = onnx.load(str(model))
    inits = {i.name: i for i in m.graph.initializer}
    wanted = set(nodes)
    return {
        n.input[1]: tensor_stats(numpy_helper.to_array(inits[n.input[1]]))
        for n in m.graph.node
        if n.name in wanted and len(n.input) > 1 and n.input[1] in inits
    }


def activation_stats(calib: Calibration) -> dict[str, dict[str, float]]:
    """Calibration statistics in the shared vocabulary (``absmax_over_std``, ``outlier_share``)."""
    out = {}
    for name, s in calib.stats.items():
        absmax = max(abs(s["min"]), abs(s["max"]))
        out[name] = {
            **s,
            "absmax": absmax,
            "absmax_over_std": absmax / s["std"] if s["std"] > 0 else 0.0,
        }
    return out


def analyse(calib: Calibration, weights: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Summary for the record: the recommendation, the worst tensors, histograms to plot."""
    acts = activation_stats(calib)
    method, reason = recommend_calibration(acts)
    order = sorted(acts, key=lambda k: (-acts[k]["outlier_share"], -acts[k]["absmax_over_std"]))
    top_w = sorted(weights, key=lambda k: -weights[k]["absmax_over_std"])[:_TOP]
    return {
        "recommendation": {
            "method": method,
            "reason": reason,
            "heavy_tensors": sum(map(is_heavy, acts.values())),
        },
        "activation_tensors": len(acts),
        "weight_tensors": len(weights),
        "heavy_weights": sum(map(is_heavy, weights.values())),
        "activations_top": {k: _rounded(acts[k]) for k in order[:_TOP]},
        "weights_top": {k: _rounded(weights[k]) for k in top_w},
        "histograms": {k: calib.histograms[k] for k in order[:_TOP] if k in calib.histograms},
    }


def _rounded(s: dict[str, float]) -> dict[str, float]:
    return {k: float(f"{v:.5g}") for k, v in s.items()}
