"""Fallback detection: which compute ops ONNX Runtime actually runs as integer kernels.

A QDQ model only says what *should* be integer. ONNX Runtime fuses DequantizeLinear -> op ->
QuantizeLinear into integer kernels where it has one, and otherwise runs the float op between
the Q/DQ pairs, silently. The session's optimized graph is saved and counted.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import onnx

from ...measure.runners import ort_session

__all__ = ["FLOAT_COMPUTE", "INT8_COMPUTE", "WEIGHT_ONLY", "kernel_report"]

INT8_COMPUTE = frozenset(
    {
        "QLinearConv",
        "QLinearMatMul",
        "QGemm",
        "MatMulInteger",
        "ConvInteger",
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
        "QAttention",
        "DynamicQuantizeLSTM",
        "QLinearConvTranspose",
        "NhwcQLinearConv",
    }
)
# int8 weights, float arithmetic: smaller, but not an INT8 compute kernel
WEIGHT_ONLY = frozenset({"MatMulNBits", "MatMulBnb4"})
FLOAT_COMPUTE = frozenset(
    {
        "Conv",
        "ConvTranspose",
        "FusedConv",
        "NhwcFusedConv",
        "MatMul",
        "FusedMatMul",
        "Gemm",
        "FusedGemm",
        "Attention",
        "MultiHeadAttention",
    }
)
LARGE_FLOAT_SHARE = 0.2


def _optimized_graph(path: Path, threads: int) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "optimized.onnx"
        ort_session(path, threads, optimized_out=out, level="all")
        return onnx.load(str(out), load_external_data=False)


def kernel_report(path: Path, threads: int = 1) -> dict[str, Any]:
    """Count integer vs float compute kernels in the graph ONNX Runtime runs for ``path``.

    ``fallback`` lists float compute kernels fed by a DequantizeLinear (quantized on paper, float
    at run time) and weight-only kernels; ``float_by_choice`` counts float kernels with no
    quantized input (kept in float by the precision plan or never quantizable).
    """
    graph = _optimized_graph(path, threads).graph
    producers = {o: n for n in graph.node for o in n.output}
    int8 = [n for n in graph.node if n.op_type in INT8_COMPUTE]
    floats = [n for n in graph.node if n.op_type in FLOAT_COMPUTE | WEIGHT_ONLY]
    fallback = [n for n in floats if n.op_type in WEIGHT_ONLY or _fed_by_dq(n, producers)]
    total = len(int8) + len(floats)
    return {
        "int8_kernels": len(int8),
        "compute_kernels": total,
        "summary": f"{len(int8)} of {total} quantizable ops run INT8",
        "int8_share": len(int8) / total if total else 0.0,
        "fallback": [{"node": n.name, "op_type": n.op_type} for n in fallback],
        "float_by_choice": len(floats) - len(fallback),
        "kernels": dict(sorted(Counter(n.op_type for n in [*int8, *floats]).items())),
    }


def _fed_by_dq(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto]) -> bool:
    return any(
        (p := producers.get(i)) is not None and p.op_type == "DequantizeLinear"
        for i in node.input
        if i
    )


def fallback_warning(name: str, report: dict[str, Any]) -> str | None:
    """A warning when a large share of the compute ops quantized on paper runs in float."""
    total = report["compute_kernels"]
    n = len(report["fallback"])
    if total and n / total > LARGE_FLOAT_SHARE:
        ops = Counter(f["op_type"] for f in report["fallback"])
        kinds = ", ".join(f"{v} {k}" for k, v in ops.most_common())
        return (
            f"{name}: {n} of {total} compute ops were quantized but ONNX Runtime runs them as "
            f"float kernels between Q/DQ pairs ({kinds}); {report['summary']}"
        )
    return None
