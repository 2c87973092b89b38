"""The ops of :mod:`.onnx_module`'s ONNX-to-torch converter: one function per ONNX op, adding the
fx nodes (and ``torch.nn`` modules holding the weights) that compute it, or raising a
:class:`~slimline.errors.StepError` that names the node and what it cannot reproduce."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch import fx, nn

from ...errors import StepError

__all__ = ["CONVERTERS", "Builder", "Dims", "Env", "attrs", "unsupported"]

Env = dict[str, Any]  # ONNX value name -> fx node, or a numpy constant
HUGE = 2**62  # Slice ends at or past this mean "to the end"


class Builder:
    """Adds one fx node per ONNX node; constants stay numpy arrays until an op needs them (a
    weight becomes a parameter, a one-element operand a Python float, a larger one a buffer)."""

    def __init__(self, shapes: dict[str, list[int | None]], opset: int, free_batch: bool) -> None:
        self.root = nn.Module()
        self.graph = fx.Graph()
        self.env: Env = {}
        self.count = 0
        self.shapes, self.opset, self.free_batch = shapes, opset, free_batch

    def module(self, prefix: str, mod: nn.Module, *args: Any) -> fx.Node:
        self.count += 1
        name = f"{prefix}_{self.count}"
        self.root.add_module(name, mod)
        return self.graph.call_module(name, tuple(args))

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> fx.Node:
        return self.graph.call_function(fn, tuple(args), kwargs)

    def operand(self, name: str) -> Any:
        value = self.env[name]
        if not isinstance(value, np.ndarray):
            return value
        if value.size == 1 and value.ndim == 0:
            return float(value)
        self.count += 1
        buf = f"const_{self.count}"
        self.root.register_buffer(buf, torch.from_numpy(np.array(value)))
        return self.graph.get_attr(buf)

    def scalar_operand(self, name: str, rank: int | None) -> Any:
        """A one-element constant as a float where broadcasting it cannot add axes."""
        value = self.env[name]
        if isinstance(value, np.ndarray) and value.size == 1 and (rank or 0) >= value.ndim:
            return float(value.reshape(()))
        return self.operand(name)

    def const(self, node: onnx.NodeProto, index: int) -> np.ndarray:
        value = self.env[node.input[index]]
        if not isinstance(value, np.ndarray):
            raise unsupported(node, f"input {index} ({node.input[index]}) must be a constant")
        return value

    def optional(self, node: onnx.NodeProto, index: int) -> np.ndarray | None:
        if len(node.input) <= index or not node.input[index]:
            return None
        return self.const(node, index)

    def rank(self, name: str) -> int | None:
        dims = self.shapes.get(name)
        return len(dims) if dims is not None else None


def unsupported(node: onnx.NodeProto, why: str) -> StepError:
    return StepError(
        f"ONNX op {node.op_type} (node {node.name or node.output[0]}) cannot be converted to a "
        f"trainable torch module: {why}; QAT needs a torch task for this model (a task .py whose "
        "model() returns it), or use quantize without QAT"
    )


def attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pads(node: onnx.NodeProto, a: dict[str, Any]) -> tuple[int, int]:
    """The 2-D padding of a convolution or pool: symmetric and explicit, or an error."""
    pads = list(a.get("pads", [0, 0, 0, 0]))
    auto = _text(a.get("auto_pad", "NOTSET"))
    if auto not in ("NOTSET", "VALID") or len(pads) != 4 or pads[:2] != pads[2:]:
        raise unsupported(node, f"only symmetric explicit pads are supported, got {pads}")
    return int(pads[0]), int(pads[1])


def _conv2d_only(node: onnx.NodeProto, w: np.ndarray) -> None:
    if w.ndim != 4:
        raise unsupported(node, f"only 2-D convolutions are supported (weight {list(w.shape)})")


def _conv(b: Builder, node: onnx.NodeProto) -> Any:
    a, w, bias = attrs(node), b.const(node, 1), b.optional(node, 2)
    _conv2d_only(node, w)
    group = int(a.get("group", 1))
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


def _conv_transpose(b: Builder, node: onnx.NodeProto) -> Any:
    a, w, bias = attrs(node), b.const(node, 1), b.optional(node, 2)
    _conv2d_only(node, w)
    if "output_shape" in a:
        raise unsupported(node, "output_shape is not supported (give pads)")
    group = int(a.get("group", 1))
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


def _load(mod: nn.Module, w: np.ndarray, bias: np.ndarray | None) -> None:
    with torch.no_grad():
        weight = mod.weight
        assert isinstance(weight, torch.Tensor)
        weight.copy_(torch.from_numpy(np.array(w, np.float32)))
        if bias is not None:
            assert isinstance(mod.bias, torch.Tensor)
            mod.bias.copy_(torch.from_numpy(np.array(bias, np.float32).reshape(-1)))


def _batchnorm(b: Builder, node: onnx.NodeProto) -> Any:
    a = attrs(node)
    scale, shift, mean, var = (np.array(b.const(node, i), np.float32) for i in range(1, 5))
    bn = nn.BatchNorm2d(len(scale), eps=float(a.get("epsilon", 1e-5)))
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(scale))
        bn.bias.copy_(torch.from_numpy(shift))
        assert bn.running_mean is not None and bn.running_var is not None
        bn.running_mean.copy_(torch.from_numpy(mean))
        bn.running_var.copy_(torch.from_numpy(var))
    return b.module("bn", bn.eval(), b.env[node.input[0]])


def _gemm(b: Builder, node: onnx.NodeProto) -> Any:
    """Gemm or MatMul with a constant 2-D right operand: an ``nn.Linear``."""
    a = attrs(node)
    w = b.const(node, 1)
    if node.op_type == "Gemm":
        if (
            a.get("transA", 0)
            or float(a.get("alpha", 1.0)) != 1.0
            or float(a.get("beta", 1.0)) != 1.0
        ):
            raise unsupported(node, "only transA 0, alpha 1 and beta 1 are supported")
        if not a.get("transB", 0):
            w = w.T
    else:
        w = w.T
    if w.ndim != 2:
        raise unsupported(node, f"the constant operand must be 2-D (got {list(w.shape)})")
    bias = b.optional(node, 2) if node.op_type == "Gemm" else None
    if bias is not None and bias.size != w.shape[0]:
        raise unsupported(node, f"bias of shape {list(bias.shape)} is not per output")
    linear = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    _load(linear, w, bias)
    return b.module("linear", linear, b.env[node.input[0]])


def _binary(
    fn: Callable[..., Any], swapped: Callable[..., Any]
) -> Callable[[Builder, onnx.NodeProto], Any]:
    """``fn(x, y)``; where only ``y`` is a tensor, ``swapped(y, x)`` computes the same (torch's
    functions want the tensor first)."""

    def convert(b: Builder, node: onnx.NodeProto) -> Any:
        if any(isinstance(b.env[n], Dims) for n in node.input):
            raise unsupported(node, "arithmetic on a shape computed from Shape")
        ranks = [b.rank(n) for n in node.input]
        x = b.scalar_operand(node.input[0], ranks[1])
        y = b.scalar_operand(node.input[1], ranks[0])
        if isinstance(x, float):
            return b.call(swapped, y, x)
        return b.call(fn, x, y)

    return convert


def _rsub(y: Any, x: float) -> Any:
    return operator.sub(x, y)


def _rdiv(y: Any, x: float) -> Any:
    return operator.truediv(x, y)


def _clip(b: Builder, node: onnx.NodeProto) -> Any:
    a = attrs(node)
    lo, hi = b.optional(node, 1), b.optional(node, 2)
    low = float(lo) if lo is not None else a.get("min")
    high = float(hi) if hi is not None else a.get("max")
    return b.call(torch.clamp, b.env[node.input[0]], low, high)


def _hard_sigmoid(b: Builder, node: onnx.NodeProto) -> Any:
    a = attrs(node)
    x = b.call(torch.mul, b.env[node.input[0]], float(a.get("alpha", 0.2)))
    x = b.call(torch.add, x, float(a.get("beta", 0.5)))
    return b.call(torch.clamp, x, 0.0, 1.0)


def _resize(b: Builder, node: onnx.NodeProto) -> Any:
    """Nearest (asymmetric, floor: torch's ``nearest``) or bilinear (half-pixel or
    align-corners) resizing of an NCHW tensor by constant scales or sizes."""
    a = attrs(node)
    mode = _text(a.get("mode", "nearest"))
    coords = _text(a.get("coordinate_transformation_mode", "half_pixel"))
    if node.op_type == "Upsample" or b.opset < 11:  # scales are input 1; asymmetric, floor
        coords, nearest = "asymmetric", "floor"
        scales, sizes = b.optional(node, 1), None
    else:
        nearest = _text(a.get("nearest_mode", "round_prefer_floor"))
        scales, sizes = b.optional(node, 2), b.optional(node, 3)
    kwargs: dict[str, Any] = {}
    if mode == "nearest" and coords == "asymmetric" and nearest == "floor":
        kwargs["mode"] = "nearest"
    elif mode == "linear" and coords in ("half_pixel", "pytorch_half_pixel", "align_corners"):
        kwargs.update(mode="bilinear", align_corners=coords == "align_corners")
    else:
        raise unsupported(
            node,
            f"mode {mode} with {coords} coordinates (nearest_mode {nearest}); supported: nearest "
            "asymmetric floor, linear half_pixel or align_corners",
        )
    if scales is not None and scales.size == 4 and tuple(scales[:2]) == (1.0, 1.0):
        kwargs["scale_factor"] = (float(scales[2]), float(scales[3]))
    elif sizes is not None and sizes.size == 4:
        kwargs["size"] = (int(sizes[2]), int(sizes[3]))
    else:
        raise unsupported(node, "only constant spatial scales or sizes of an NCHW input")
    return b.call(F.interpolate, b.env[node.input[0]], **kwargs)


def _concat(b: Builder, node: onnx.NodeProto) -> Any:
    if any(isinstance(b.env[n], Dims) for n in node.input):
        return Dims(d for n in node.input for d in _dims(b, node, n))
    inputs = [b.operand(n) for n in node.input]
    return b.call(torch.cat, inputs, dim=int(attrs(node)["axis"]))


def _pool(b: Builder, node: onnx.NodeProto) -> Any:
    a = attrs(node)
    kernel = tuple(a["kernel_shape"])
    if len(kernel) != 2:
        raise unsupported(node, f"only 2-D pooling is supported (kernel {list(kernel)})")
    stride, padding = tuple(a.get("strides", [1, 1])), _pads(node, a)
    ceil = bool(a.get("ceil_mode", 0))
    x = b.env[node.input[0]]
    if node.op_type == "MaxPool":
        if len(node.output) > 1 and node.output[1]:
            raise unsupported(node, "the Indices output is not supported")
        dilation = tuple(a.get("dilations", [1, 1]))
        pool = nn.MaxPool2d(kernel, stride, padding, dilation, ceil_mode=ceil)
        return b.module("maxpool", pool, x)
    include = bool(a.get("count_include_pad", 0))
    avg = nn.AvgPool2d(kernel, stride, padding, ceil_mode=ceil, count_include_pad=include)
    return b.module("avgpool", avg, x)


def _slice(b: Builder, node: onnx.NodeProto) -> Any:
    """Constant starts / ends / axes / steps: Python indexing."""
    if b.opset < 10:
        a = attrs(node)
        starts, ends = list(a["starts"]), list(a["ends"])
        axes, steps = list(a.get("axes", range(len(starts)))), [1] * len(starts)
    else:
        starts, ends = b.const(node, 1).tolist(), b.const(node, 2).tolist()
        axes_c, steps_c = b.optional(node, 3), b.optional(node, 4)
        axes = axes_c.tolist() if axes_c is not None else list(range(len(starts)))
        steps = steps_c.tolist() if steps_c is not None else [1] * len(starts)
    x = b.env[node.input[0]]
    if isinstance(x, Dims):  # a computed shape: a list slice
        (start, end, step) = (starts[0], ends[0], steps[0]) if axes in ([0], [-1]) else (0, 0, 0)
        if not step:
            raise unsupported(node, "a shape is sliced on its one axis")
        return Dims(x[start : None if end >= HUGE else end : step])
    rank = b.rank(node.input[0])
    if any(ax < 0 for ax in axes) and rank is None:
        raise unsupported(node, "negative axes need the input's rank, which is unknown")
    axes = [ax + rank if ax < 0 and rank is not None else ax for ax in axes]
    index: list[Any] = [slice(None)] * (max(axes) + 1)
    for ax, start, end, step in zip(axes, starts, ends, steps, strict=True):
        if step < 0:
            raise unsupported(node, "negative steps are not supported")
        stop = None if end >= HUGE else end
        index[ax] = slice(start, stop, step if step != 1 else None)
    return b.call(operator.getitem, x, tuple(index))


def _reshape(b: Builder, node: onnx.NodeProto) -> Any:
    x = b.env[node.input[0]]
    shape: list[Any] = list(_dims(b, node, node.input[1]))
    allowzero = bool(attrs(node).get("allowzero", 0))
    dims = b.shapes.get(node.input[0]) or []
    if b.free_batch and shape and shape[0] == 1 and dims[:1] == [1]:
        shape[0] = 0  # the fixed batch of 1: keep the input's first axis, whatever its rows
    for i, v in enumerate(shape):
        if isinstance(v, int) and v == 0 and not allowzero:
            shape[i] = b.graph.call_method("size", (x, i))
    return b.graph.call_method("reshape", (x, tuple(shape)))


def _flatten(b: Builder, node: onnx.NodeProto) -> Any:
    if int(attrs(node).get("axis", 1)) != 1:
        raise unsupported(node, "only axis 1 is supported")
    return b.call(torch.flatten, b.env[node.input[0]], 1)


def _transpose(b: Builder, node: onnx.NodeProto) -> Any:
    perm = attrs(node).get("perm")
    if perm is None:
        rank = b.rank(node.input[0])
        if rank is None:
            raise unsupported(node, "a Transpose without perm needs the input's rank")
        perm = list(reversed(range(rank)))
    return b.call(torch.permute, b.env[node.input[0]], tuple(perm))


def _softmax(b: Builder, node: onnx.NodeProto) -> Any:
    axis, rank = int(attrs(node).get("axis", -1 if b.opset >= 13 else 1)), b.rank(node.input[0])
    last = axis == -1 or (rank is not None and axis == rank - 1)
    if b.opset < 13 and not last:  # older Softmax flattens the axes from ``axis`` on
        raise unsupported(node, f"opset {b.opset} Softmax over axis {axis} (not the last)")
    return b.call(torch.softmax, b.env[node.input[0]], axis)


def _axes(b: Builder, node: onnx.NodeProto) -> list[int]:
    given = attrs(node).get("axes")
    if given is None and len(node.input) > 1:
        given = b.const(node, 1).tolist()
    if given is None:
        raise unsupported(node, "axes must be given")
    return [int(v) for v in given]


def _squeeze(b: Builder, node: onnx.NodeProto) -> Any:
    x = b.env[node.input[0]]
    rank = b.rank(node.input[0])
    axes = _axes(b, node)
    if any(ax < 0 for ax in axes) and rank is None:
        raise unsupported(node, "negative axes need the input's rank, which is unknown")
    for ax in sorted(
        (ax + rank if ax < 0 and rank is not None else ax for ax in axes), reverse=True
    ):
        x = b.call(torch.squeeze, x, ax)
    return x


def _unsqueeze(b: Builder, node: onnx.NodeProto) -> Any:
    x, axes = b.env[node.input[0]], _axes(b, node)
    if isinstance(x, Dims):
        if not x.scalar or axes not in ([0], [-1]):
            raise unsupported(node, "a computed shape is unsqueezed from one entry only")
        return Dims(x)
    if any(ax < 0 for ax in axes):
        raise unsupported(node, "negative axes are not supported")
    for ax in sorted(axes):
        x = b.call(torch.unsqueeze, x, ax)
    return x


def _unary(fn: Callable[..., Any], *args: Any) -> Callable[[Builder, onnx.NodeProto], Any]:
    def convert(b: Builder, node: onnx.NodeProto) -> Any:
        return b.call(fn, b.env[node.input[0]], *args)

    return convert


def _relu(b: Builder, node: onnx.NodeProto) -> Any:
    return b.module("relu", nn.ReLU(), b.env[node.input[0]])


def _leaky_relu(b: Builder, node: onnx.NodeProto) -> Any:
    return b.call(F.leaky_relu, b.env[node.input[0]], float(attrs(node).get("alpha", 0.01)))


def _identity(b: Builder, node: onnx.NodeProto) -> Any:
    return b.env[node.input[0]]


class Dims(list[Any]):
    """A shape the graph computes (``Shape`` and the ops after it, e.g. ``Reshape(x,
    Concat(Slice(Shape(y), 0, 1), [-1]))``): its entries are ints, or fx nodes for the axes
    known only at run time (the rows' axis always). ``scalar``: one entry taken by ``Gather``."""

    scalar = False


def _dims(b: Builder, node: onnx.NodeProto, name: str) -> Dims:
    value = b.env[name]
    if isinstance(value, Dims):
        return value
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu" and value.ndim <= 1:
        return Dims(int(v) for v in value.reshape(-1))
    raise unsupported(node, f"{name} must be a constant or a shape computed from Shape")


def _shape(b: Builder, node: onnx.NodeProto) -> Any:
    x, a = b.env[node.input[0]], attrs(node)
    static = b.shapes.get(node.input[0])
    if static is None:
        raise unsupported(node, "the input's rank is unknown")
    dims = Dims(
        d if d is not None and i > 0 else b.graph.call_method("size", (x, i))
        for i, d in enumerate(static)
    )
    return Dims(dims[int(a.get("start", 0)) : a.get("end")])


def _cast(b: Builder, node: onnx.NodeProto) -> Any:
    x, to = b.env[node.input[0]], int(attrs(node)["to"])
    if isinstance(x, Dims) or to == onnx.TensorProto.FLOAT:
        return x  # a shape's type is moot; float stays float
    raise unsupported(node, f"a cast of a tensor to {onnx.TensorProto.DataType.Name(to)}")


def _gather(b: Builder, node: onnx.NodeProto) -> Any:
    x, index = b.env[node.input[0]], b.const(node, 1)
    if not isinstance(x, Dims) or int(attrs(node).get("axis", 0)) != 0:
        raise unsupported(node, "only entries of a computed shape are gathered")
    out = Dims(x[int(i)] for i in index.reshape(-1))
    out.scalar = index.ndim == 0
    return out


def _split(b: Builder, node: onnx.NodeProto) -> list[Any]:
    """Split into the given sizes (the ``split`` attribute before opset 13, the input from
    13), or into as many equal parts as it has outputs (the last one smaller where the axis
    does not divide, as opset 18 says): one fx node per output."""
    a = attrs(node)
    sizes = a.get("split") if b.opset < 13 else b.optional(node, 1)
    x, axis = b.env[node.input[0]], int(a.get("axis", 0))
    if isinstance(x, Dims):
        raise unsupported(node, "a computed shape is split")
    if sizes is not None and len(sizes):
        parts = b.call(torch.split, x, [int(n) for n in np.asarray(sizes).reshape(-1)], axis)
    else:
        parts = b.call(torch.chunk, x, int(a.get("num_outputs", len(node.output))), axis)
    return [b.call(operator.getitem, parts, i) for i in range(len(node.output))]


CONVERTERS: dict[str, Callable[[Builder, onnx.NodeProto], Any]] = {
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "BatchNormalization": _batchnorm,
    "Gemm": _gemm,
    "MatMul": _gemm,
    "Relu": _relu,
    "LeakyRelu": _leaky_relu,
    "Sigmoid": _unary(torch.sigmoid),
    "Tanh": _unary(torch.tanh),
    "HardSigmoid": _hard_sigmoid,
    "HardSwish": _unary(F.hardswish),
    "Clip": _clip,
    "Add": _binary(torch.add, torch.add),
    "Sub": _binary(torch.sub, _rsub),
    "Mul": _binary(torch.mul, torch.mul),
    "Div": _binary(torch.div, _rdiv),
    "GlobalAveragePool": _unary(F.adaptive_avg_pool2d, 1),
    "MaxPool": _pool,
    "AveragePool": _pool,
    "Resize": _resize,
    "Upsample": _resize,
    "Concat": _concat,
    "Split": _split,
    "Slice": _slice,
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Transpose": _transpose,
    "Softmax": _softmax,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Identity": _identity,
    "Shape": _shape,
    "Cast": _cast,
    "Gather": _gather,
}
