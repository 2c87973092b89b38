"""An ONNX graph as a ``torch.fx.GraphModule`` that QAT can train: every Conv / ConvTranspose /
BatchNormalization becomes a real ``torch.nn`` module holding the ONNX weights as parameters, the
element-wise ops become the torch functions that FX graph mode quantization knows (``torch.add``,
``torch.mul``, ``torch.clamp``, ``F.interpolate``, ``torch.cat``...), and scalar constants stay
Python numbers. Only the op set of CNNs like PP-OCR's (listed in ``CONVERTERS``) is covered; any
other op is an error naming it.

Why not ``onnx2torch`` (1.5.15, the PyPI converter): here it cannot be imported (it imports
``torchvision`` at import time, and PyPI's torchvision fails to import beside the CPU build of
torch 2.13: "operator torchvision::nms does not exist"); with that import stubbed out it needs
Constant nodes turned into initializers, then its module of PP-OCRv4's detector disagrees with
ONNX Runtime (cosine 0.03 on the same input), and ``prepare_qat_fx`` cannot re-trace it (its
``Div`` module branches on a traced value).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import fx, nn

__all__ = ["CONVERTERS", "to_torch"]

Env = dict[str, Any]  # ONNX value name -> fx node, or a numpy constant


class _Builder:
    """Adds one fx node per ONNX node; constants are kept as numpy arrays until an op needs them
    (a weight becomes a parameter, a one-element operand a Python float, a larger one a
    buffer)."""

    def __init__(self) -> None:
        self.root = nn.Module()
        self.graph = fx.Graph()
        self.env: Env = {}
        self.count = 0

    def module(self, prefix: str, mod: nn.Module, *args: Any) -> fx.Node:
        self.count += 1
        name = f"{prefix}_{self.count}"
        self.root.add_module(name, mod)
        return self.graph.call_module(name, tuple(args))

    def operand(self, name: str) -> Any:
        value = self.env[name]
        if not isinstance(value, np.ndarray):
            return value
        if value.size == 1:
            return float(value.reshape(()))
        self.count += 1
        buf = f"const_{self.count}"
        self.root.register_buffer(buf, torch.from_numpy(np.array(value)))
        return self.graph.get_attr(buf)

    def const(self, name: str) -> np.ndarray:
        value = self.env[name]
        if not isinstance(value, np.ndarray):
            raise ValueError(f"{name} must be a constant for this converter")
        return value


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _pads(node: onnx.NodeProto, a: dict[str, Any]) -> tuple[int, int]:
    pads = list(a.get("pads", [0, 0, 0, 0]))
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or pads[:2] != pads[2:]:
        raise ValueError(f"{node.name}: only symmetric explicit pads are supported, got {pads}")
    return pads[0], pads[1]


def _conv_operands(b: _Builder, node: onnx.NodeProto) -> tuple[dict[str, Any], Any, Any, int]:
    """A Conv or ConvTranspose node's attributes, weight, bias (or None) and group count."""
    a = _attrs(node)
    w = b.const(node.input[1])
    bias = b.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    return a, w, bias, int(a.get("group", 1))


def _conv(b: _Builder, node: onnx.NodeProto) -> Any:
    a, w, bias, group = _conv_operands(b, node)
    conv = nn.Conv2d(
        w.shape[1] * group,
        w.shape[0],
        tuple(w.shape[2:]),
        stride=tuple(a.get("strides", [1, 1])),
        padding=_pads(node, a),
        dilation=tuple(a.get("dilations", [1, 1])),
        groups=group,
        bias=bias is not None,
    )
    _load(conv, w, bias)
    return b.module("conv", conv, b.env[node.input[0]])


def _conv_transpose(b: _Builder, node: onnx.NodeProto) -> Any:
    a, w, bias, group = _conv_operands(b, node)
    conv = nn.ConvTranspose2d(
        w.shape[0],
        w.shape[1] * group,
        tuple(w.shape[2:]),
        stride=tuple(a.get("strides", [1, 1])),
        padding=_pads(node, a),
        output_padding=tuple(a.get("output_padding", [0, 0])),
        dilation=tuple(a.get("dilations", [1, 1])),
        groups=group,
        bias=bias is not None,
    )
    _load(conv, w, bias)
    return b.module("deconv", conv, b.env[node.input[0]])


def _load(mod: nn.Conv2d | nn.ConvTranspose2d, w: np.ndarray, bias: np.ndarray | None) -> None:
    with torch.no_grad():
        mod.weight.copy_(torch.from_numpy(np.array(w)))
        if bias is not None:
            assert isinstance(mod.bias, torch.Tensor)
            mod.bias.copy_(torch.from_numpy(np.array(bias)))


def _batchnorm(b: _Builder, node: onnx.NodeProto) -> Any:
    a = _attrs(node)
    scale, shift, mean, var = (np.array(b.const(n)) for n in node.input[1:5])
    bn = nn.BatchNorm2d(len(scale), eps=float(a.get("epsilon", 1e-5)))
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(scale))
        bn.bias.copy_(torch.from_numpy(shift))
        assert bn.running_mean is not None and bn.running_var is not None
        bn.running_mean.copy_(torch.from_numpy(mean))
        bn.running_var.copy_(torch.from_numpy(var))
    return b.module("bn", bn.eval(), b.env[node.input[0]])


def _binary(fn: Callable[..., Any]) -> Callable[[_Builder, onnx.NodeProto], Any]:
    def convert(b: _Builder, node: onnx.NodeProto) -> Any:
        x, y = (b.operand(n) for n in node.input)
        if not isinstance(x, fx.Node) and fn in (torch.add, torch.mul):
            x, y = y, x  # commutative: the tensor first, as torch.add(tensor, scalar) wants
        return b.graph.call_function(fn, (x, y))

    return convert


def _clip(b: _Builder, node: onnx.NodeProto) -> Any:
    a = _attrs(node)
    lo = b.operand(node.input[1]) if len(node.input) > 1 and node.input[1] else a.get("min")
    hi = b.operand(node.input[2]) if len(node.input) > 2 and node.input[2] else a.get("max")
    return b.graph.call_function(torch.clamp, (b.env[node.input[0]], lo, hi))


def _hard_sigmoid(b: _Builder, node: onnx.NodeProto) -> Any:
    a = _attrs(node)
    alpha, beta = float(a.get("alpha", 0.2)), float(a.get("beta", 0.5))
    x = b.graph.call_function(torch.mul, (b.env[node.input[0]], alpha))
    x = b.graph.call_function(torch.add, (x, beta))
    return b.graph.call_function(torch.clamp, (x, 0.0, 1.0))


def _resize(b: _Builder, node: onnx.NodeProto) -> Any:
    a = _attrs(node)
    mode = (a.get("mode", b"nearest"), a.get("coordinate_transformation_mode", b"half_pixel"))
    nearest = a.get("nearest_mode", b"round_prefer_floor")
    if mode != (b"nearest", b"asymmetric") or nearest != b"floor":
        raise ValueError(f"{node.name}: only nearest/asymmetric/floor Resize is supported")
    scales = b.const(node.input[2]) if len(node.input) > 2 and node.input[2] else np.empty(0)
    if scales.size != 4 or tuple(scales[:2]) != (1.0, 1.0):
        raise ValueError(f"{node.name}: only constant spatial scales are supported")
    factor = (float(scales[2]), float(scales[3]))
    return b.graph.call_function(
        F.interpolate, (b.env[node.input[0]],), {"scale_factor": factor, "mode": "nearest"}
    )


def _concat(b: _Builder, node: onnx.NodeProto) -> Any:
    inputs = [b.env[n] for n in node.input]
    return b.graph.call_function(torch.cat, (inputs,), {"dim": int(_attrs(node)["axis"])})


def _unary(fn: Callable[..., Any], *args: Any) -> Callable[[_Builder, onnx.NodeProto], Any]:
    def convert(b: _Builder, node: onnx.NodeProto) -> Any:
        return b.graph.call_function(fn, (b.env[node.input[0]], *args))

    return convert


def _relu(b: _Builder, node: onnx.NodeProto) -> Any:
    return b.module("relu", nn.ReLU(), b.env[node.input[0]])


CONVERTERS: dict[str, Callable[[_Builder, onnx.NodeProto], Any]] = {
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "BatchNormalization": _batchnorm,
    "Relu": _relu,
    "Sigmoid": _unary(torch.sigmoid),
    "HardSigmoid": _hard_sigmoid,
    "Clip": _clip,
    "Add": _binary(torch.add),
    "Sub": _binary(torch.sub),
    "Mul": _binary(torch.mul),
    "Div": _binary(torch.div),
    "GlobalAveragePool": _unary(F.adaptive_avg_pool2d, 1),
    "Resize": _resize,
    "Concat": _concat,
}


def to_torch(model: onnx.ModelProto) -> fx.GraphModule:
    """``model`` as a GraphModule (eval mode) taking its graph inputs by name, returning its
    first output."""
    b = _Builder()
    for init in model.graph.initializer:
        b.env[init.name] = numpy_helper.to_array(init)
    for inp in model.graph.input:
        if inp.name not in b.env:
            b.env[inp.name] = b.graph.placeholder(inp.name)
    for node in model.graph.node:
        if node.op_type == "Constant":
            b.env[node.output[0]] = numpy_helper.to_array(_attrs(node)["value"])
            continue
        convert = CONVERTERS.get(node.op_type)
        if convert is None:
            raise ValueError(f"unsupported ONNX op {node.op_type} (node {node.name})")
        b.env[node.output[0]] = convert(b, node)
    b.graph.output(b.env[model.graph.output[0].name])
    module = fx.GraphModule(b.root, b.graph)
    module.eval()
    return module
