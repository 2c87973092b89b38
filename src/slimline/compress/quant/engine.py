"""Apply one :class:`QuantSpec` to a prepared float graph with ONNX Runtime's quantization tool."""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from ...errors import StepError
from ...record import atomic_write_bytes
from .config import QuantSpec
from .float_inputs import float_inputs_file
from .prepare import COMPUTE_OPS, QDQ_MIN_OPSET, default_opset, quiet

__all__ = ["DYNAMIC_OP_TYPES", "EMBEDDING_OP_TYPES", "ort_quantize_static", "quantize_model"]

# ConvInteger is slower than float Conv on x86; dynamic quantization is for MatMul-heavy graphs.
DYNAMIC_OP_TYPES = ["MatMul", "Attention"]
# Embedding tables: ONNX Runtime's integer-ops quantizer stores a Gather's constant table and a
# fused EmbedLayerNormalization's word/position/segment tables as UINT8 (QEmbedLayerNormalization).
EMBEDDING_OP_TYPES = ["Gather", "EmbedLayerNormalization"]


def _qtype(name: str) -> object:
    from onnxruntime.quantization import QuantType

    return QuantType.QUInt8 if name == "uint8" else QuantType.QInt8


def quantize_model(
    src: Path,
    dst: Path,
    spec: QuantSpec,
    float_nodes: list[str],
    caches: dict[str, Path] | None = None,
) -> Path:
    """Quantize ``src`` into ``dst`` (atomically), keeping ``float_nodes`` in float.

    Static specs read their ranges from ``caches[spec.calibration]`` (written by
    :func:`slimline.compress.quant.calibrate.calibrate`); nothing is recalibrated here. A float
    node reads its input through a per-axis DequantizeLinear of its own (:mod:`.float_inputs`):
    fed by a per-tensor one, ONNX Runtime would quantize its float weights per tensor at load.
    """
    with tempfile.TemporaryDirectory() as tmp, quiet():
        out = Path(tmp) / "q.onnx"
        try:
            if spec.mode == "static":
                ort_quantize_static(src, out, spec, float_nodes, caches or {})
                float_inputs_file(out)  # float nodes stay float under ONNX Runtime
            else:
                _dynamic(src, out, spec, float_nodes)
        except StepError:
            raise
        except Exception as err:
            raise StepError(
                f"ONNX Runtime could not quantize {src.name} ({spec.label}): {err}"
            ) from err
        atomic_write_bytes(dst, onnx.load(str(out)).SerializeToString())
    return dst


def _extra(spec: QuantSpec) -> dict[str, object]:
    return {
        "ActivationSymmetric": spec.activation_symmetric,
        "WeightSymmetric": spec.weight_symmetric,
        "DefaultTensorType": onnx.TensorProto.FLOAT,
    }


def ort_quantize_static(
    src: Path, out: Path, spec: QuantSpec, float_nodes: list[str], caches: dict[str, Path]
) -> None:
    """ONNX Runtime's static QDQ quantizer alone, with ``spec``'s settings and the ranges in
    ``caches``: no float-input rewrite, no atomic write, its errors unwrapped. Use
    :func:`quantize_model`; this is the quantizer's own output, for diagnosis."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    opset = default_opset(onnx.load(str(src), load_external_data=False))
    if spec.per_channel and opset < QDQ_MIN_OPSET:
        raise StepError(
            f"{spec.label} needs opset {QDQ_MIN_OPSET} or later (per-channel DequantizeLinear "
            f"takes an axis from opset 13), and {src.name} is opset {opset}"
        )
    cache = caches.get(spec.calibration)
    if cache is None:
        raise StepError(
            f"no {spec.calibration} calibration was run for {spec.label}; calibrate first"
        )
    method = {
        "minmax": CalibrationMethod.MinMax,
        "percentile": CalibrationMethod.Percentile,
        "entropy": CalibrationMethod.Entropy,
    }[spec.calibration]
    quantize_static(
        str(src),
        str(out),
        calibration_data_reader=None,
        quant_format=QuantFormat.QDQ,
        per_channel=spec.per_channel,
        activation_type=_qtype(spec.activation_type),
        weight_type=_qtype(spec.weight_type),
        nodes_to_exclude=list(float_nodes),
        op_types_to_quantize=list(COMPUTE_OPS) if spec.ops == "compute" else None,
        calibrate_method=method,
        reduce_range=spec.reduce_range,
        extra_options=_extra(spec),
        calibration_cache_path=str(cache),
    )


def _dynamic(src: Path, out: Path, spec: QuantSpec, float_nodes: list[str]) -> None:
    from onnxruntime.quantization import quantize_dynamic

    quantize_dynamic(
        str(src),
        str(out),
        op_types_to_quantize=DYNAMIC_OP_TYPES + (EMBEDDING_OP_TYPES if spec.embeddings else []),
        per_channel=spec.per_channel,
        reduce_range=spec.reduce_range,
        weight_type=_qtype(spec.weight_type),
        nodes_to_exclude=list(float_nodes),
        extra_options={
            "WeightSymmetric": spec.weight_symmetric,
            "DefaultTensorType": onnx.TensorProto.FLOAT,
        },
    )
