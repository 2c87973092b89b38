"""An ONNX graph as a ``torch.fx.GraphModule`` that QAT can train (``qat`` on an ONNX task).

Every Conv / ConvTranspose / BatchNormalization / Gemm becomes a real ``torch.nn`` module holding
the ONNX weights as parameters, the element-wise and data-movement ops become the torch functions
FX graph mode quantization knows (``torch.add``, ``torch.mul``, ``torch.clamp``,
``F.interpolate``, ``torch.cat``...), and scalar constants stay Python numbers. Nodes whose
inputs are all constants are folded with ONNX's reference evaluator. The op set is that of the
zoo's CNNs and detectors (PP-OCR's, YOLOX's: :data:`CONVERTERS`); any other op, or an attribute
the converter does not reproduce, is a :class:`~slimline.errors.StepError` naming it.

With ``free_batch`` (a model whose batch is fixed at 1), a constant ``Reshape`` whose first
entry is 1 where its input's first axis is 1 keeps the input's first axis instead (ONNX's ``0``),
so the module trains on batches of several rows.

Why not a converter from PyPI: ``onnx2torch`` 1.5.15 and ``onnx2pytorch`` 0.6.0, the maintained
ones, both import ``torchvision`` when imported (for their NMS / RoIAlign / DeformConv ops), and
torchvision cannot be imported beside the CPU build of torch 2.13 here. Earlier (bench), with the
import stubbed out, ``onnx2torch``'s module of PP-OCRv4's detector disagreed with ONNX Runtime
(cosine 0.03) and ``prepare_qat_fx`` could not re-trace it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import fx, nn

from ...candidate import Candidate, quantizable_graph
from ...context import StepContext
from ...errors import StepError

__all__ = ["CONVERTERS", "check_against_onnx", "module_for", "rename_output", "to_torch"]

Env = dict[str, Any]  # ONNX value name -> fx node, or a numpy constant
HUGE = 2**62  # Slice ends at or past this mean "to the end"
# the output scale below which the conversion check's error bound stops shrinking: a probability
# map that is ~0 everywhere (a text detector on a text-free photo) is compared within 1e-6
MIN_SCALE = 1e-2
CHECK_ROWS = 32  # sample rows the conversion is checked on
CHECK_BOUND = 0.9999  # cosine to ONNX Runtime per row


class _Builder:
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
            raise _unsupported(node, f"input {index} ({node.input[index]}) must be a constant")
        return value

    def optional(self, node: onnx.NodeProto, index: int) -> np.ndarray | None:
        if len(node.input) <= index or not node.input[index]:
            return None
        return self.const(node, index)

    def rank(self, name: str) -> int | None:
        dims = self.shapes.get(name)
        return len(dims) if dims is not None else None


def _unsupported(node: onnx.NodeProto, why: str) -> StepError:
    return StepError(
        f"ONNX op {node.op_type} (node {node.name or node.output[0]}) cannot be converted to a "
        f"trainable torch module: {why}; QAT needs a torch task for this model (a task .py whose "
        "model() returns it), or use quantize without QAT"
    )


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pads(node: onnx.NodeProto, a: dict[str, Any]) -> tuple[int, int]:
    """The 2-D padding of a convolution or pool: symmetric and explicit, or an error."""
    pads = list(a.get("pads", [0, 0, 0, 0]))
    auto = _text(a.get("auto_pad", "NOTSET"))
    if auto not in ("NOTSET", "VALID") or len(pads) != 4 or pads[:2] != pads[2:]:
        raise _unsupported(node, f"only symmetric explicit pads are supported, got {pads}")
    return int(pads[0]), int(pads[1])


def _conv2d_only(node: onnx.NodeProto, w: np.ndarray) -> None:
    if w.ndim != 4:
        raise _unsupported(node, f"only 2-D convolutions are supported (weight {list(w.shape)})")


def _conv(b: _Builder, node: onnx.NodeProto) -> Any:
    a, w, bias = _attrs(node), b.const(node, 1), b.optional(node, 2)
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


def _conv_transpose(b: _Builder, node: onnx.NodeProto) -> Any:
    a, w, bias = _attrs(node), b.const(node, 1), b.optional(node, 2)
    _conv2d_only(node, w)
    if "output_shape" in a:
        raise _unsupported(node, "output_shape is not supported (give pads)")
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


def _batchnorm(b: _Builder, node: onnx.NodeProto) -> Any:
    a = _attrs(node)
    scale, shift, mean, var = (np.array(b.const(node, i), np.float32) for i in range(1, 5))
    bn = nn.BatchNorm2d(len(scale), eps=float(a.get("epsilon", 1e-5)))
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(scale))
        bn.bias.copy_(torch.from_numpy(shift))
        assert bn.running_mean is not None and bn.running_var is not None
        bn.running_mean.copy_(torch.from_numpy(mean))
        bn.running_var.copy_(torch.from_numpy(var))
    return b.module("bn", bn.eval(), b.env[node.input[0]])


def _gemm(b: _Builder, node: onnx.NodeProto) -> Any:
    """Gemm or MatMul with a constant 2-D right operand: an ``nn.Linear``."""
    a = _attrs(node)
    w = b.const(node, 1)
    if node.op_type == "Gemm":
        if (
            a.get("transA", 0)
            or float(a.get("alpha", 1.0)) != 1.0
            or float(a.get("beta", 1.0)) != 1.0
        ):
            raise _unsupported(node, "only transA 0, alpha 1 and beta 1 are supported")
        if not a.get("transB", 0):
            w = w.T
    else:
        w = w.T
    if w.ndim != 2:
        raise _unsupported(node, f"the constant operand must be 2-D (got {list(w.shape)})")
    bias = b.optional(node, 2) if node.op_type == "Gemm" else None
    if bias is not None and bias.size != w.shape[0]:
        raise _unsupported(node, f"bias of shape {list(bias.shape)} is not per output")
    linear = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    _load(linear, w, bias)
    return b.module("linear", linear, b.env[node.input[0]])


def _binary(
    fn: Callable[..., Any], swapped: Callable[..., Any]
) -> Callable[[_Builder, onnx.NodeProto], Any]:
    """``fn(x, y)``; where only ``y`` is a tensor, ``swapped(y, x)`` computes the same (torch's
    functions want the tensor first)."""

    def convert(b: _Builder, node: onnx.NodeProto) -> Any:
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


def _clip(b: _Builder, node: onnx.NodeProto) -> Any:
    a = _attrs(node)
    lo, hi = b.optional(node, 1), b.optional(node, 2)
    low = float(lo) if lo is not None else a.get("min")
    high = float(hi) if hi is not None else a.get("max")
    return b.call(torch.clamp, b.env[node.input[0]], low, high)


def _hard_sigmoid(b: _Builder, node: onnx.NodeProto) -> Any:
    a = _attrs(node)
    x = b.call(torch.mul, b.env[node.input[0]], float(a.get("alpha", 0.2)))
    x = b.call(torch.add, x, float(a.get("beta", 0.5)))
    return b.call(torch.clamp, x, 0.0, 1.0)


def _resize(b: _Builder, node: onnx.NodeProto) -> Any:
    """Nearest (asymmetric, floor: torch's ``nearest``) or bilinear (half-pixel or
    align-corners) resizing of an NCHW tensor by constant scales or sizes."""
    a = _attrs(node)
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
        raise _unsupported(
            node,
            f"mode {mode} with {coords} coordinates (nearest_mode {nearest}); supported: nearest "
            "asymmetric floor, linear half_pixel or align_corners",
        )
    if scales is not None and scales.size == 4 and tuple(scales[:2]) == (1.0, 1.0):
        kwargs["scale_factor"] = (float(scales[2]), float(scales[3]))
    elif sizes is not None and sizes.size == 4:
        kwargs["size"] = (int(sizes[2]), int(sizes[3]))
    else:
        raise _unsupported(node, "only constant spatial scales or sizes of an NCHW input")
    return b.call(F.interpolate, b.env[node.input[0]], **kwargs)


def _concat(b: _Builder, node: onnx.NodeProto) -> Any:
    inputs = [b.operand(n) for n in node.input]
    return b.call(torch.cat, inputs, dim=int(_attrs(node)["axis"]))


def _pool(b: _Builder, node: onnx.NodeProto) -> Any:
    a = _attrs(node)
    kernel = tuple(a["kernel_shape"])
    if len(kernel) != 2:
        raise _unsupported(node, f"only 2-D pooling is supported (kernel {list(kernel)})")
    stride, padding = tuple(a.get("strides", [1, 1])), _pads(node, a)
    ceil = bool(a.get("ceil_mode", 0))
    x = b.env[node.input[0]]
    if node.op_type == "MaxPool":
        if len(node.output) > 1 and node.output[1]:
            raise _unsupported(node, "the Indices output is not supported")
        dilation = tuple(a.get("dilations", [1, 1]))
        pool = nn.MaxPool2d(kernel, stride, padding, dilation, ceil_mode=ceil)
        return b.module("maxpool", pool, x)
    include = bool(a.get("count_include_pad", 0))
    avg = nn.AvgPool2d(kernel, stride, padding, ceil_mode=ceil, count_include_pad=include)
    return b.module("avgpool", avg, x)


def _slice(b: _Builder, node: onnx.NodeProto) -> Any:
    """Constant starts / ends / axes / steps: Python indexing."""
    if b.opset < 10:
        a = _attrs(node)
        starts, ends = list(a["starts"]), list(a["ends"])
        axes, steps = list(a.get("axes", range(len(starts)))), [1] * len(starts)
    else:
        starts, ends = b.const(node, 1).tolist(), b.const(node, 2).tolist()
        axes_c, steps_c = b.optional(node, 3), b.optional(node, 4)
        axes = axes_c.tolist() if axes_c is not None else list(range(len(starts)))
        steps = steps_c.tolist() if steps_c is not None else [1] * len(starts)
    rank = b.rank(node.input[0])
    if any(ax < 0 for ax in axes) and rank is None:
        raise _unsupported(node, "negative axes need the input's rank, which is unknown")
    axes = [ax + rank if ax < 0 and rank is not None else ax for ax in axes]
    index: list[Any] = [slice(None)] * (max(axes) + 1)
    for ax, start, end, step in zip(axes, starts, ends, steps, strict=True):
        if step < 0:
            raise _unsupported(node, "negative steps are not supported")
        stop = None if end >= HUGE else end
        index[ax] = slice(start, stop, step if step != 1 else None)
    return b.call(operator.getitem, b.env[node.input[0]], tuple(index))


def _reshape(b: _Builder, node: onnx.NodeProto) -> Any:
    x = b.env[node.input[0]]
    shape: list[Any] = [int(v) for v in b.const(node, 1).tolist()]
    allowzero = bool(_attrs(node).get("allowzero", 0))
    dims = b.shapes.get(node.input[0]) or []
    if b.free_batch and shape and shape[0] == 1 and dims[:1] == [1]:
        shape[0] = 0  # the fixed batch of 1: keep the input's first axis, whatever its rows
    for i, v in enumerate(shape):
        if v == 0 and not allowzero:
            shape[i] = b.graph.call_method("size", (x, i))
    return b.graph.call_method("reshape", (x, tuple(shape)))


def _flatten(b: _Builder, node: onnx.NodeProto) -> Any:
    if int(_attrs(node).get("axis", 1)) != 1:
        raise _unsupported(node, "only axis 1 is supported")
    return b.call(torch.flatten, b.env[node.input[0]], 1)


def _transpose(b: _Builder, node: onnx.NodeProto) -> Any:
    perm = _attrs(node).get("perm")
    if perm is None:
        rank = b.rank(node.input[0])
        if rank is None:
            raise _unsupported(node, "a Transpose without perm needs the input's rank")
        perm = list(reversed(range(rank)))
    return b.call(torch.permute, b.env[node.input[0]], tuple(perm))


def _softmax(b: _Builder, node: onnx.NodeProto) -> Any:
    axis, rank = int(_attrs(node).get("axis", -1 if b.opset >= 13 else 1)), b.rank(node.input[0])
    last = axis == -1 or (rank is not None and axis == rank - 1)
    if b.opset < 13 and not last:  # older Softmax flattens the axes from ``axis`` on
        raise _unsupported(node, f"opset {b.opset} Softmax over axis {axis} (not the last)")
    return b.call(torch.softmax, b.env[node.input[0]], axis)


def _axes(b: _Builder, node: onnx.NodeProto) -> list[int]:
    given = _attrs(node).get("axes")
    if given is None and len(node.input) > 1:
        given = b.const(node, 1).tolist()
    if given is None:
        raise _unsupported(node, "axes must be given")
    return [int(v) for v in given]


def _squeeze(b: _Builder, node: onnx.NodeProto) -> Any:
    x = b.env[node.input[0]]
    rank = b.rank(node.input[0])
    axes = _axes(b, node)
    if any(ax < 0 for ax in axes) and rank is None:
        raise _unsupported(node, "negative axes need the input's rank, which is unknown")
    for ax in sorted(
        (ax + rank if ax < 0 and rank is not None else ax for ax in axes), reverse=True
    ):
        x = b.call(torch.squeeze, x, ax)
    return x


def _unsqueeze(b: _Builder, node: onnx.NodeProto) -> Any:
    x, axes = b.env[node.input[0]], _axes(b, node)
    if any(ax < 0 for ax in axes):
        raise _unsupported(node, "negative axes are not supported")
    for ax in sorted(axes):
        x = b.call(torch.unsqueeze, x, ax)
    return x


def _unary(fn: Callable[..., Any], *args: Any) -> Callable[[_Builder, onnx.NodeProto], Any]:
    def convert(b: _Builder, node: onnx.NodeProto) -> Any:
        return b.call(fn, b.env[node.input[0]], *args)

    return convert


def _relu(b: _Builder, node: onnx.NodeProto) -> Any:
    return b.module("relu", nn.ReLU(), b.env[node.input[0]])


def _leaky_relu(b: _Builder, node: onnx.NodeProto) -> Any:
    return b.call(F.leaky_relu, b.env[node.input[0]], float(_attrs(node).get("alpha", 0.01)))


def _identity(b: _Builder, node: onnx.NodeProto) -> Any:
    return b.env[node.input[0]]


CONVERTERS: dict[str, Callable[[_Builder, onnx.NodeProto], Any]] = {
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
    "Slice": _slice,
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Transpose": _transpose,
    "Softmax": _softmax,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Identity": _identity,
}


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Each value's dims where ONNX shape inference finds them (a free dim is ``None``)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is a help, not a requirement
        inferred = model
    g = inferred.graph
    out: dict[str, list[int | None]] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return out


def _fold(node: onnx.NodeProto, env: Env, opset: int) -> list[np.ndarray]:
    """A node whose inputs are all constants, evaluated by ONNX's reference evaluator."""
    from onnx.reference import ReferenceEvaluator

    inputs = [n for n in node.input if n]
    graph = onnx.helper.make_graph(
        [node],
        "fold",
        [
            onnx.helper.make_tensor_value_info(
                n, onnx.helper.np_dtype_to_tensor_dtype(env[n].dtype), None
            )
            for n in inputs
        ],
        [
            onnx.helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None)
            for n in node.output
        ],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        result = ReferenceEvaluator(model).run(None, {n: env[n] for n in inputs})
    except Exception as err:
        raise _unsupported(node, f"its constant inputs could not be folded ({err})") from None
    return [np.asarray(r) for r in result]


def _check_graph(model: onnx.ModelProto) -> int:
    """The default domain's opset; one float output and identifier-named inputs, or an error."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    outputs = [o.name for o in model.graph.output]
    if len(outputs) != 1:
        raise StepError(
            f"QAT from an ONNX file trains a model with one output, and this one has "
            f"{len(outputs)} ({', '.join(outputs)}); use quantize without QAT for it"
        )
    inits = {i.name for i in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        if not inp.name.isidentifier():
            raise StepError(
                f"QAT from an ONNX file needs inputs named as Python identifiers, and input "
                f"{inp.name!r} is not one; rename it in the ONNX file (and the samples)"
            )
        if inp.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
            raise StepError(
                f"QAT from an ONNX file trains on float32 inputs, and input {inp.name!r} is "
                f"{onnx.TensorProto.DataType.Name(inp.type.tensor_type.elem_type)}"
            )
    return opset


def to_torch(model: onnx.ModelProto, *, free_batch: bool = False) -> fx.GraphModule:
    """``model`` as a GraphModule (eval mode) taking its graph inputs by name, returning its one
    output; a :class:`StepError` names the first op (or attribute) it cannot convert."""
    opset = _check_graph(model)
    b = _Builder(_shapes(model), opset, free_batch)
    for init in model.graph.initializer:
        b.env[init.name] = numpy_helper.to_array(init)
    for inp in model.graph.input:
        if inp.name not in b.env:
            b.env[inp.name] = b.graph.placeholder(inp.name)
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            raise _unsupported(node, f"ops of domain {node.domain} are not supported")
        if node.op_type == "Constant":
            b.env[node.output[0]] = numpy_helper.to_array(_attrs(node)["value"])
            continue
        if all(isinstance(b.env.get(n), np.ndarray) for n in node.input if n):
            for name, value in zip(node.output, _fold(node, b.env, opset), strict=False):
                b.env[name] = value
            continue
        convert = CONVERTERS.get(node.op_type)
        if convert is None:
            raise StepError(
                f"unsupported ONNX op {node.op_type} (node {node.name or node.output[0]}): the "
                f"ONNX-to-torch converter for QAT covers {len(CONVERTERS)} ops of CNNs and "
                "detectors, not this one; QAT needs a torch task for this model (a task .py "
                "whose model() returns it), or use quantize without QAT"
            )
        b.env[node.output[0]] = convert(b, node)
    out = b.env[model.graph.output[0].name]
    if not isinstance(out, fx.Node):
        raise StepError("the ONNX model's output is a constant: there is nothing to train")
    b.graph.output(out)
    module = fx.GraphModule(b.root, b.graph)
    module.eval()
    return module


def rename_output(path: Path, name: str) -> None:
    """Give the one output of the exported QDQ file ``path`` the source model's name, so that
    the task's declarations (``outputs:``), its signature and its metric hook read it."""
    model = onnx.load(str(path))
    old = model.graph.output[0].name
    if old == name:
        return
    for node in model.graph.node:
        node.output[:] = [name if o == old else o for o in node.output]
        node.input[:] = [name if i == old else i for i in node.input]
    model.graph.output[0].name = name
    onnx.save(model, str(path))


def check_against_onnx(
    module: Any,
    run_onnx: Callable[[dict[str, np.ndarray]], np.ndarray],
    batches: Iterable[dict[str, np.ndarray]],
    rows: int,
    bound: float,
) -> dict[str, Any]:
    """The converted ``module`` against the ONNX model (``run_onnx``: its output on a batch) on
    up to ``rows`` sample rows: each row's cosine must reach ``bound``, or, for a row whose
    output is close to 0 everywhere (where cosine measures float noise), its largest error must
    stay within ``1 - bound`` of the largest output over all rows (at least of
    :data:`MIN_SCALE`). Returns the figures; a :class:`StepError` where a row fails."""
    got, want, seen = [], [], 0
    with torch.no_grad():
        for batch in batches:
            x = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}
            got.append(module(**x).float().numpy())
            want.append(np.asarray(run_onnx(batch), np.float32))
            seen += len(got[-1])
            if seen >= rows:
                break
    a = np.concatenate(got)[:rows].reshape(min(seen, rows), -1).astype(np.float64)
    r = np.concatenate(want)[:rows].reshape(len(a), -1).astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(r, axis=1)
    cos = np.where(norms > 0, (a * r).sum(1) / np.where(norms > 0, norms, 1.0), 1.0)
    err = np.abs(a - r).max(1)
    scale = max(float(np.abs(r).max()), MIN_SCALE)
    ok = (cos >= bound) | (err <= (1.0 - bound) * scale)
    out = {
        "rows": len(a),
        "cosine_mean": float(cos.mean()),
        "cosine_min": float(cos.min()),
        "max_abs_err": float(err.max()),
        "bound": bound,
        "rows_within": int(ok.sum()),
    }
    if not ok.all():
        raise StepError(
            f"the torch module converted from the ONNX file disagrees with ONNX Runtime on "
            f"{int((~ok).sum())} of {len(a)} rows (cosine min {cos.min():.6f} < {bound}, max "
            f"abs error {err.max():.3g}); QAT needs a torch task for this model"
        )
    return out


def module_for(cand: Candidate, ctx: StepContext) -> tuple[Any, dict[str, Any]]:
    """The trainable FP32 torch module of ``cand``'s float ONNX graph (an ONNX task's), checked
    against ONNX Runtime on the task's calibration rows, and the record of that: the file, the
    output's name (the QDQ export is given it back) and the check's figures."""
    from ...measure.runners import OrtRunner

    path = quantizable_graph(cand)
    model = onnx.load(str(path))
    sig = ctx.task.signature
    module = to_torch(model, free_batch=sig is not None and sig.max_batch == 1)
    output = model.graph.output[0].name
    runner = OrtRunner(cand.name, path, ctx.threads, sig)
    check = check_against_onnx(
        module,
        lambda batch: runner.run_all(batch)[output],
        ctx.task.calibration_data(),
        CHECK_ROWS,
        CHECK_BOUND,
    )
    ops = sorted({n.op_type for n in model.graph.node})
    return module, {"source": path.name, "output": output, "ops": ops, "check": check}
