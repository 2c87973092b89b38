"""Store the QDQ export's weights as INT8: the TorchScript exporter writes each fake-quantized
weight as a float initializer followed by QuantizeLinear; ONNX Runtime folds that at load time,
but the file would keep FP32 weights. Each QuantizeLinear whose inputs are all constants is
replaced by its INT8 (or UINT8) result, so the file holds what DequantizeLinear reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ...record import atomic_write_bytes

__all__ = ["drop_unused", "fold_constant_quantizers", "graph_constants"]


def graph_constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Initializers, Constant nodes and Identity nodes of constants, by output name."""
    values = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        elif node.op_type == "Identity" and node.input[0] in values:
            values[node.output[0]] = values[node.input[0]]
    return values


def _quantize(x: np.ndarray, scale: np.ndarray, zp: np.ndarray, axis: int) -> np.ndarray:
    """ONNX QuantizeLinear: round half to even, add the zero point, saturate to its type."""
    if scale.ndim == 1 and scale.size > 1:  # per axis
        shape = [1] * x.ndim
        shape[axis] = scale.size
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    info = np.iinfo(zp.dtype)
    q = np.rint(x / scale) + zp.astype(np.int32)
    out: np.ndarray = np.clip(q, info.min, info.max).astype(zp.dtype)
    return out


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 1)


def fold_constant_quantizers(path: Path) -> int:
    """Rewrite ``path`` (atomically) with constant QuantizeLinear nodes folded; returns how many."""
    model = onnx.load(str(path))
    graph = model.graph
    values = graph_constants(graph)
    keep: list[onnx.NodeProto] = []
    folded: list[onnx.TensorProto] = []
    for node in graph.node:
        ins = list(node.input)
        if node.op_type == "QuantizeLinear" and len(ins) == 3 and all(i in values for i in ins):
            q = _quantize(values[ins[0]], values[ins[1]], values[ins[2]], _axis(node))
            folded.append(numpy_helper.from_array(q, node.output[0]))
        else:
            keep.append(node)
    if not folded:
        return 0
    del graph.node[:]
    graph.node.extend(keep)
    graph.initializer.extend(folded)
    drop_unused(graph)
    atomic_write_bytes(path, model.SerializeToString())
    return len(folded)


def drop_unused(graph: onnx.GraphProto) -> None:
    """Remove nodes and initializers nothing reads any more (the float weights)."""
    while True:
        used: set[str] = {o.name for o in graph.output}
        for node in graph.node:
            used.update(i for i in node.input if i)
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        for n in dead:
            graph.node.remove(n)
        if not dead:
            break
    unused: list[Any] = [i for i in graph.initializer if i.name not in used]
    for init in unused:
        graph.initializer.remove(init)
