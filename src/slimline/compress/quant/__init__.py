"""INT8 quantization engine: graph preparation, chunked calibration, QDQ/dynamic quantization,
fallback detection, layer-wise error and automatic search with mixed precision.

The recipe step is :mod:`.step`, with its config in :mod:`.config`; the other modules are plain
functions (ONNX path in, ONNX path out) so they can be used and tested without a pipeline.
"""

from __future__ import annotations

from .calibrate import Calibration, calibrate
from .config import QuantizeConfig, QuantSpec
from .engine import quantize_model
from .fallback import kernel_report
from .layerwise import layer_errors
from .plan import PrecisionPlan, resolve_plan
from .prepare import Prepared, prepare

__all__ = [
    "Calibration",
    "PrecisionPlan",
    "Prepared",
    "QuantSpec",
    "QuantizeConfig",
    "calibrate",
    "kernel_report",
    "layer_errors",
    "prepare",
    "quantize_model",
    "resolve_plan",
]
