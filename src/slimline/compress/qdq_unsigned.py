"""Signed activations of a QDQ graph, re-encoded as unsigned without changing a value.

NNCF's ONNX backend writes INT8 activation Q/DQ pairs (zero point 0 for its symmetric preset,
another for ``mixed``). On an x86 CPU without VNNI, OpenVINO 2026.4 reads such a file to noise:
PP-OCRv4's detector, NNCF's file with the overflow fix on every layer, mean cosine to FP32 on
all evaluation rows 0.045 on OpenVINO and 0.899 on ONNX Runtime; re-encoded, 0.901 on
OpenVINO and 0.898 on ONNX Runtime (bench/RESULTS-ov-int8.md, ``nncf-onnx-signed`` against
``nncf-onnx``). The re-encoding keeps every value: ``q_u8 = q_s8 + 128`` with
``zero_point_u8 = zero_point_s8 + 128`` on the QuantizeLinear and on every DequantizeLinear
that reads it dequantizes to the same values, and the saturation bounds (-128..127 against
0..255) move with it. Weights keep their signed encoding (U8S8, the format x86 kernels take).
Kernels are another matter. Without VNNI a U8S8 kernel adds its products in saturating 16-bit
pairs, so the re-encoding is for files whose weights are 7-bit (NNCF's overflow fix on every
layer). And a runtime may round differently on the U8 path than on the S8 one: ONNX Runtime
gives the same outputs on ddddocr's detector and the tiny CNN of the tests, and a cosine of
0.898 against 0.899 on PP-OCRv4's detector.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["unsigned_activations"]


def unsigned_activations(model: Any) -> int:
    """Re-encode ``model``'s signed activation Q/DQ pairs as unsigned, in place; returns how many
    QuantizeLinear nodes changed. An activation's QuantizeLinear (its input is not a constant)
    with an INT8 zero point changes when every node reading it is a DequantizeLinear with the
    same zero point and it is not a graph output; anything else is left as it was."""
    from onnx import TensorProto, numpy_helper

    from .qat.qdq import drop_unused, graph_constants

    g = model.graph
    consts = graph_constants(g)
    readers: dict[str, list[Any]] = {}
    for n in g.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    outputs = {o.name for o in g.output}
    changed: set[str] = set()
    for q in [n for n in g.node if n.op_type == "QuantizeLinear"]:
        zp = consts.get(q.input[2]) if len(q.input) > 2 else None
        if q.input[0] in consts or zp is None or zp.dtype != np.int8 or q.output[0] in outputs:
            continue
        dqs = readers.get(q.output[0], [])
        if not dqs or any(
            d.op_type != "DequantizeLinear"
            or len(d.input) < 3
            or not np.array_equal(consts.get(d.input[2], np.array(None)), zp)
            for d in dqs
        ):
            continue
        name = f"{q.output[0]}_zero_point_u8"
        u8 = (zp.astype(np.int16) + 128).astype(np.uint8)
        g.initializer.append(numpy_helper.from_array(u8, name))
        for node in (q, *dqs):
            node.input[2] = name
        changed.add(q.output[0])
    for vi in g.value_info:
        if vi.name in changed:
            vi.type.tensor_type.elem_type = TensorProto.UINT8
    drop_unused(g)  # the signed zero points nothing reads now
    return len(changed)
