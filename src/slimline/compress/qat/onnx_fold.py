"""A convolution's per-channel bias ``Add`` folded into the convolution, before the ONNX graph
becomes a torch module for QAT.

Some exporters (paddle2onnx, PP-OCRv5's detector) write every convolution without a bias and add
the bias in a separate ``Add`` of a ``[1, C, 1, 1]`` constant. Converted as they stand, the QAT
student fake-quantizes the convolution's output before that ``Add``, and the exported QDQ model
runs each ``Add`` in float between a ``DequantizeLinear`` and the next op, where full INT8 PTQ
(whose graph ONNX Runtime optimizes first) has the bias inside the INT8 convolution. Folded, the
output's range covers the biased values, as PTQ's does, and the export has no float ``Add``. The
fold is exact in FP32 (the conversion check against ONNX Runtime still compares with the file).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["fold_conv_bias"]


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        elif node.op_type == "Reshape" and all(n in values for n in node.input[:2]):
            shape = [int(d) for d in values[node.input[1]].reshape(-1)]
            if 0 not in shape:  # 0 copies an input dimension: left to the converter
                values[node.output[0]] = values[node.input[0]].reshape(shape)
    return values


def _channel_bias(value: np.ndarray | None, channels: int) -> np.ndarray | None:
    """``value`` as a bias of ``channels`` where it adds per channel to ``[N, C, H, W]``."""
    if value is None or value.dtype != np.float32 or value.size != channels:
        return None
    if tuple(value.shape) in ((1, channels, 1, 1), (channels, 1, 1)):
        return value.reshape(channels)
    return None


def fold_conv_bias(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` where each 2-D ``Conv`` without a bias whose one consumer is an
    ``Add`` of a per-channel constant (an initializer, a ``Constant``, or a ``Reshape`` of
    them) takes that constant as its bias (the ``Add`` removed; a ``Reshape`` left without a
    consumer is skipped by the converter's constant folding); ``model`` is left as it was."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    consts = _constants(out)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    dropped: list[onnx.NodeProto] = []
    for conv in graph.node:
        weight = consts.get(conv.input[1]) if len(conv.input) > 1 else None
        if conv.op_type != "Conv" or weight is None or weight.ndim != 4:
            continue
        if len(conv.input) > 2 and conv.input[2]:
            continue
        users = consumers.get(conv.output[0], [])
        if len(users) != 1 or users[0].op_type != "Add" or conv.output[0] in outputs:
            continue
        add = users[0]
        other = add.input[1] if add.input[0] == conv.output[0] else add.input[0]
        bias = _channel_bias(consts.get(other), weight.shape[0])
        if bias is None or other == conv.output[0]:
            continue
        name = f"{conv.output[0]}__folded_bias"
        graph.initializer.append(numpy_helper.from_array(bias.astype(np.float32), name))
        while len(conv.input) < 3:
            conv.input.append("")
        conv.input[2] = name
        conv.output[0] = add.output[0]
        dropped.append(add)
    for add in dropped:
        graph.node.remove(add)
    return out
