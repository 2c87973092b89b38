"""NNCF post-training quantization, the OpenVINO-native INT8 path, as a candidate.

``nncf.quantize`` runs on the float ONNX graph with the task's calibration data
(``nncf.Dataset``) and returns a QDQ ONNX model: OpenVINO runs it on its INT8 kernels, and
ONNX Runtime loads the same file, so the candidate reloads on either runtime and is measured
on both.

Two ways in: the ``nncf`` step on its own (float ONNX -> INT8 ONNX), or ``quantize: {nncf:
true}``, where the NNCF model is built from the same float graph and calibration data as the
quantize step's own QDQ candidates and competes with them on the same budget (the pipeline
judges it against the same parent on each runtime; see :func:`nncf_alternative`). Beside it,
``quantize: {nncf: true}`` builds NNCF's documented OpenVINO path (:mod:`.nncf_ov`) where the
target runs OpenVINO, and the measured winner is kept.

A graph older than opset 13 is converted to 13 first: NNCF's ONNX backend quantizes the weights
of an opset 10-12 graph per tensor (a per-channel DequantizeLinear needs opset 13's ``axis``),
and per-tensor weights cost the zoo's CNN detectors most of their INT8 fidelity
(bench/RESULTS-ov-int8.md).

On an x86 CPU without VNNI (``cpu.detect().u8s8_saturates``) OpenVINO, like ONNX Runtime, adds
U8S8 products in saturating 16-bit pairs: ``overflow_fix: auto`` then quantizes every
convolution's and MatMul's weights to half the 8-bit range (NNCF's ``OverflowFix.ENABLE``),
and leaves NNCF's default (the first layer only) elsewhere. With the fix on every layer there,
the activation pairs NNCF writes as INT8 are re-encoded as UINT8, the same dequantized values
(:mod:`.qdq_unsigned`): OpenVINO reads the signed ones to noise on such a CPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from ..candidate import Candidate, quantizable_graph
from ..config import StepConfig
from ..context import StepContext
from ..cpu import CpuInt8
from ..cpu import detect as detect_cpu
from ..errors import RuntimeMissingError, error_text, is_user_error
from ..signature import Signature, n_rows, split_rows
from ..steps import Contract, step
from ..tensors import Inputs
from .qdq_unsigned import unsigned_activations

__all__ = [
    "COMPETES",
    "NncfConfig",
    "advanced_parameters",
    "calibration_items",
    "nncf_alternative",
    "nncf_quantize_onnx",
    "nncf_step",
    "overflow_fix_for",
    "require_nncf",
]

# meta key: an alternative the pipeline judges against the step's parent like the chosen one
COMPETES = "competes"


class NncfConfig(StepConfig):
    """NNCF PTQ (``nncf.quantize``) on the float ONNX graph."""

    kind: ClassVar[str] = "nncf"
    samples: int = Field(300, ge=1, le=100_000, description="calibration samples (subset_size)")
    preset: Literal["performance", "mixed"] = Field(
        "performance", description="performance: symmetric activations; mixed: asymmetric"
    )
    model_type: Literal["auto", "transformer", "default"] = Field(
        "auto", description="auto: transformer when the graph has Softmax"
    )
    fast_bias_correction: bool = True
    overflow_fix: Literal["auto", "enable", "first_layer_only", "disable"] = Field(
        "auto",
        description="auto: enable (7-bit weights in every convolution and MatMul) on x86 without "
        "VNNI, where U8S8 sums saturate; NNCF's default (first layer only) elsewhere",
    )


def overflow_fix_for(choice: str, cpu: CpuInt8) -> str | None:
    """NNCF's ``OverflowFix`` value for ``choice`` on ``cpu``; None: NNCF's own default.

    ``auto`` picks ``enable`` where U8S8 products saturate (x86 without VNNI: OpenVINO's AVX2
    and AVX512 kernels add them in 16-bit pairs), and NNCF's default elsewhere."""
    if choice != "auto":
        return choice
    return "enable" if cpu.u8s8_saturates else None


def advanced_parameters(overflow_fix: str | None) -> Any:
    """``AdvancedQuantizationParameters`` with ``overflow_fix`` set; None for NNCF's defaults."""
    if overflow_fix is None:
        return None
    require_nncf()
    from nncf.quantization.advanced_parameters import (
        AdvancedQuantizationParameters,
        OverflowFix,
    )

    return AdvancedQuantizationParameters(overflow_fix=OverflowFix(overflow_fix))


def require_nncf() -> Any:
    try:
        import nncf
    except ImportError:
        raise RuntimeMissingError(
            "NNCF quantization needs the nncf package, which is not installed: "
            "pip install 'slimline[openvino]'"
        ) from None
    return nncf


def _rows(batches: Iterable[Inputs], sig: Signature | None, limit: int) -> Iterator[Inputs]:
    """Calibration items as the model takes them: whole batches, or one row at a time for a
    model that takes one row per call; at most ``limit`` rows in all."""
    seen = 0
    for batch in batches:
        one_row = sig is not None and sig.max_batch == 1
        parts = split_rows(batch, 1, sig) if one_row else [batch]
        for part in parts:
            if seen >= limit:
                return
            seen += n_rows(part, sig) if sig is not None else len(next(iter(part.values())))
            yield part


def calibration_items(
    calibration: Iterable[Inputs], sig: Signature | None, limit: int
) -> list[Inputs]:
    """The calibration rows NNCF gets, the same for both backends: at most ``limit`` rows."""
    return list(_rows(calibration, sig, limit))


def _at_opset_13(model: Any) -> tuple[Any, int | None]:
    """``model`` converted to opset 13 where it is older (NNCF's ONNX backend quantizes an
    opset 10-12 graph's weights per tensor); (model, the opset it was converted from)."""
    from onnx import version_converter

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    if opset >= 13:
        return model, None
    try:
        return version_converter.convert_version(model, 13), opset
    except Exception:  # a graph the converter cannot take: per-tensor weights, as before
        return model, None


def _model_type(model: Any, choice: str) -> Any:
    nncf = require_nncf()
    if choice == "default":
        return None
    if choice == "transformer" or any(n.op_type == "Softmax" for n in model.graph.node):
        return nncf.ModelType.TRANSFORMER
    return None


def nncf_quantize_onnx(
    src: Path,
    calibration: Iterable[Inputs],
    out: Path,
    cfg: NncfConfig,
    signature: Signature | None = None,
    cpu: CpuInt8 | None = None,
) -> dict[str, Any]:
    """Quantize ``src`` with NNCF into ``out`` (QDQ ONNX); returns what was applied."""
    import onnx

    nncf = require_nncf()
    t0 = time.perf_counter()
    model, converted_from = _at_opset_13(onnx.load(str(src)))
    items = calibration_items(calibration, signature, cfg.samples)
    fix = overflow_fix_for(cfg.overflow_fix, cpu or detect_cpu())
    preset = nncf.QuantizationPreset.MIXED if cfg.preset == "mixed" else None
    model_type = _model_type(model, cfg.model_type)
    quantized = nncf.quantize(
        model,
        nncf.Dataset(items),
        subset_size=len(items),
        preset=preset,
        model_type=model_type,
        fast_bias_correction=cfg.fast_bias_correction,
        advanced_parameters=advanced_parameters(fix),
    )
    # without VNNI OpenVINO misreads signed activation pairs. Their unsigned twins denote the
    # same values, and with every weight 7-bit (the overflow fix on all layers) U8S8 kernels
    # do not saturate; with 8-bit weights ONNX Runtime's U8S8 would, so those stay signed
    no_vnni = (cpu or detect_cpu()).u8s8_saturates
    unsigned = unsigned_activations(quantized) if no_vnni and fix == "enable" else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(quantized, str(out))
    ops = [n.op_type for n in quantized.graph.node]
    return {
        "engine": f"nncf {nncf.__version__}",
        "backend": "onnx",
        "opset_converted_from": converted_from,
        "overflow_fix": fix or "nncf default (first_layer_only)",
        "activations_made_unsigned": unsigned,
        "preset": cfg.preset,
        "model_type": "transformer" if model_type is not None else "default",
        "calibration_items": len(items),
        "quantize_linear": ops.count("QuantizeLinear"),
        "dequantize_linear": ops.count("DequantizeLinear"),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def _build(cfg: NncfConfig, cand: Candidate, ctx: StepContext, name: str) -> Candidate:
    src = quantizable_graph(cand)
    out = ctx.workdir / "nncf" / f"{name}.onnx"
    meta = nncf_quantize_onnx(src, ctx.task.calibration_data(), out, cfg, ctx.task.signature)
    return Candidate(name=name, step="nncf", parent=cand.name, onnx=out, meta={"nncf": meta})


@step(
    NncfConfig,
    contract=Contract(consumes=("onnx",), produces=("onnx-int8",)),
    version=2,  # 2: opset-13 graph (per-channel weights); overflow fix by CPU kind
    reads=("target",),
    packages=("onnx", "nncf", "openvino", "numpy"),
)
def nncf_step(cfg: NncfConfig, cand: Candidate, ctx: StepContext) -> Candidate:
    return _build(cfg, cand, ctx, "nncf")


def nncf_alternative(cand: Candidate, ctx: StepContext, samples: int) -> Candidate:
    """The NNCF candidate built from ``cand``'s float graph and the same calibration data, as an
    alternative that competes with the step's chosen candidate. A failure (NNCF missing, an op
    it cannot handle) is a rejected alternative with its reason; the step goes on."""
    cfg = NncfConfig(samples=samples)
    try:
        alt = _build(cfg, cand, ctx, "quantize-nncf")
    except Exception as err:
        if is_user_error(err) and not isinstance(err, RuntimeMissingError):
            raise
        ctx.warn(f"quantize: the NNCF candidate was not built: {error_text(err)}")
        return Candidate(
            name="quantize-nncf",
            step="nncf",
            parent=cand.name,
            accepted=False,
            reason=f"failed: {error_text(err)}",
            meta={"failure": {"type": type(err).__name__, "error": error_text(err)}},
        )
    alt.accepted = None
    alt.meta = {**alt.meta, COMPETES: True}
    return alt
