"""Distribution statistics of weights (per layer, from an ONNX model) and of any array.

:func:`tensor_stats` describes one array (weights or recorded activations alike): range, mean,
standard deviation, percentiles, ``absmax_over_std`` and ``outlier_share``, the share of values
more than 6 standard deviations from the mean. For a Gaussian that share is about 2e-9 and
``absmax_over_std`` stays near 5 even for a million values, so larger figures mean heavy tails.

:func:`recommend_calibration` turns a set of such statistics into a calibration method for INT8
quantization. A tensor counts as *heavy-tailed* when

* ``outlier_share`` >= ``HEAVY_OUTLIER_SHARE`` (1e-4: at least 1 value in 10,000 beyond 6 std), or
* ``absmax_over_std`` >= ``HEAVY_ABSMAX_OVER_STD`` (12: the extreme value sits 12 std out).

If at least ``HEAVY_TENSOR_SHARE`` (10%) of the tensors are heavy-tailed, the recommendation is
``percentile``: MinMax would stretch the INT8 grid over a few extreme values and leave the bulk
of the distribution with a handful of levels, while Percentile clips them. Otherwise ``minmax``
keeps every value in range at no resolution cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFileError

__all__ = [
    "HEAVY_ABSMAX_OVER_STD",
    "HEAVY_OUTLIER_SHARE",
    "HEAVY_TENSOR_SHARE",
    "OUTLIER_STD",
    "PERCENTILES",
    "is_heavy",
    "recommend_calibration",
    "tensor_stats",
    "weight_stats",
]

OUTLIER_STD = 6.0
PERCENTILES = (0.1, 1.0, 50.0, 99.0, 99.9)
HEAVY_OUTLIER_SHARE = 1e-4
HEAVY_ABSMAX_OVER_STD = 12.0
HEAVY_TENSOR_SHARE = 0.1

_FLOAT_TYPES = (np.float16, np.float32, np.float64)


def _pct_key(p: float) -> str:
    return "p" + f"{p:g}".replace(".", "_")


def tensor_stats(values: np.ndarray) -> dict[str, float]:
    """Statistics of all values of ``values`` (any shape, any real dtype), JSON-serialisable.

    Keys: ``count, min, max, mean, std, p0_1, p1, p50, p99, p99_9, absmax, absmax_over_std,
    outlier_share``. ``absmax_over_std`` is 0 for a constant array.
    """
    a = np.asarray(values, dtype=np.float64).ravel()
    if a.size == 0:
        raise ValueError("tensor_stats needs at least one value")
    mean, std = float(a.mean()), float(a.std())
    absmax = float(np.abs(a).max())
    pcts = np.percentile(a, PERCENTILES)
    out = {
        "count": int(a.size),
        "min": float(a.min()),
        "max": float(a.max()),
        "mean": mean,
        "std": std,
        **{_pct_key(p): float(v) for p, v in zip(PERCENTILES, pcts, strict=True)},
        "absmax": absmax,
        "absmax_over_std": absmax / std if std > 0 else 0.0,
        "outlier_share": float((np.abs(a - mean) > OUTLIER_STD * std).mean()) if std > 0 else 0.0,
    }
    return out


def is_heavy(stats: Mapping[str, Any]) -> bool:
    """Whether one tensor's statistics show heavy tails (see the module's thresholds)."""
    return (
        float(stats["outlier_share"]) >= HEAVY_OUTLIER_SHARE
        or float(stats["absmax_over_std"]) >= HEAVY_ABSMAX_OVER_STD
    )


def recommend_calibration(
    stats: Mapping[str, Mapping[str, Any]] | Iterable[Mapping[str, Any]],
) -> tuple[str, str]:
    """``(method, reason)``: ``"percentile"`` when >= 10% of the tensors are heavy-tailed, else
    ``"minmax"``. ``stats`` is ``{name: stats}`` or a list of stats dicts with a ``name`` key."""
    rows = _named(stats)
    if not rows:
        return "minmax", "no statistics to judge by; MinMax is the safe default"
    heavy = sorted((r for r in rows if is_heavy(r)), key=lambda r: -float(r["absmax_over_std"]))
    share = len(heavy) / len(rows)
    rule = (
        f">= {HEAVY_OUTLIER_SHARE:g} of values beyond {OUTLIER_STD:g} std, or max |x| >= "
        f"{HEAVY_ABSMAX_OVER_STD:g} std"
    )
    if share >= HEAVY_TENSOR_SHARE:
        worst = heavy[0]
        return "percentile", (
            f"{len(heavy)} of {len(rows)} tensors are heavy-tailed ({rule}); worst "
            f"{worst['name']} with max |x| at {float(worst['absmax_over_std']):.1f} std: MinMax "
            "would spend the INT8 range on a few outliers, Percentile clips them"
        )
    return "minmax", (
        f"{len(heavy)} of {len(rows)} tensors are heavy-tailed ({rule}), under "
        f"{HEAVY_TENSOR_SHARE:.0%}: MinMax keeps every value in range"
    )


def _named(
    stats: Mapping[str, Mapping[str, Any]] | Iterable[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    if isinstance(stats, Mapping):
        return [{"name": k, **v} for k, v in stats.items()]
    return [dict(r) for r in stats]


def weight_stats(onnx_path: Path | str, min_size: int = 1) -> dict[str, Any]:
    """Per-layer statistics of a model's float weights, worst outlier share first.

    A weight is a float initializer with at least 2 dimensions, or any float initializer whose
    name contains ``weight``. Returns ``{"layers": [{"name", "shape", "consumer", "op_type",
    ...tensor_stats}], "recommendation": "<method>: <reason>", "calibration_method": method}``;
    the recommendation is judged on the weight matrices (ndim >= 2: what INT8 quantizes; norm
    scales and biases stay float), as a proxy: activations need calibration data.
    """
    import onnx
    from onnx import numpy_helper

    try:
        model = onnx.load(str(onnx_path))
    except Exception as err:
        raise ModelFileError(
            f"cannot read ONNX file {onnx_path} ({type(err).__name__}); check the path or "
            "re-export the model"
        ) from None
    consumers = _consumers(model)
    layers = []
    for init in model.graph.initializer:
        arr = numpy_helper.to_array(init)
        if not _is_weight(init.name, arr) or arr.size < min_size:
            continue
        node, op = consumers.get(init.name, ("", ""))
        layers.append(
            {
                "name": init.name,
                "shape": list(arr.shape),
                "consumer": node,
                "op_type": op,
                **tensor_stats(arr),
            }
        )
    layers.sort(key=lambda r: (-r["outlier_share"], -r["absmax_over_std"]))
    matrices = [r for r in layers if len(r["shape"]) >= 2]  # what INT8 quantizes
    method, reason = recommend_calibration(matrices)
    return {
        "layers": layers,
        "recommendation": f"{method}: {reason}",
        "calibration_method": method,
    }


def _is_weight(name: str, arr: np.ndarray) -> bool:
    if arr.dtype.type not in _FLOAT_TYPES or arr.size == 0:
        return False
    return arr.ndim >= 2 or "weight" in name.lower()


def _consumers(model: Any) -> dict[str, tuple[str, str]]:
    """initializer name -> (first consuming node's name, its op type)."""
    out: dict[str, tuple[str, str]] = {}
    for node in model.graph.node:
        for name in node.input:
            out.setdefault(name, (node.name, node.op_type))
    return out
