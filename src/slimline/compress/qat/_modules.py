"""The modules a QAT model trains and is exported through: learned ranges, INT32-bias twins of
the QAT layers, INT8-grid layers for export (kept apart: importing them imports torch)."""

from __future__ import annotations

import math

import torch
import torch.ao.nn.intrinsic.qat as nniqat
import torch.ao.nn.qat as nnqat
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import FakeQuantizeBase

__all__ = [
    "BIAS_TWINS",
    "ONNX_INT8",
    "LearnedRange",
    "LearnedWeightRange",
    "QConv2d",
    "QLinear",
    "bias_rounding",
    "on_int32_grid",
]

ONNX_INT8 = (-128, 127)  # the weight range the exporter accepts; learned weights lie inside it


class _QWeight(nn.Module):
    """A weight on its learned INT8 grid, exported as QuantizeLinear + DequantizeLinear (per
    output channel), with its float bias and an optional ReLU; quantizing a weight already on
    the grid changes nothing, so the export computes exactly what the fake-quant model
    computes."""

    weight: torch.Tensor
    bias: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor,
        scale: torch.Tensor,
        zp: torch.Tensor,
        relu: bool,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", zp)
        self.relu = relu

    def activation(self, y: torch.Tensor) -> torch.Tensor:
        return F.relu(y) if self.relu else y

    def round_bias(self, input_scale: float) -> None:
        """The bias on the INT32 grid of ``input_scale`` x each output channel's weight scale,
        as ONNX Runtime quantizes it for its integer kernels."""
        self.bias.copy_(on_int32_grid(self.bias, input_scale, self.scale))

    def quantized_weight(self) -> torch.Tensor:
        return torch.fake_quantize_per_channel_affine(
            self.weight, self.scale, self.zero_point, 0, *ONNX_INT8
        )


class QConv2d(_QWeight):
    """Conv2d (BatchNorm folded in, optional ReLU) with an INT8-grid weight."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor,
        scale: torch.Tensor,
        zp: torch.Tensor,
        conv: nn.Conv2d,
        relu: bool,
    ) -> None:
        super().__init__(weight, bias, scale, zp, relu)
        self.stride, self.padding = conv.stride, conv.padding
        self.dilation, self.groups = conv.dilation, conv.groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.quantized_weight()
        pad = self.padding if isinstance(self.padding, str) else tuple(self.padding)
        return self.activation(
            F.conv2d(x, w, self.bias, self.stride, pad, self.dilation, self.groups)
        )


class QLinear(_QWeight):
    """Linear (optional ReLU) with an INT8-grid weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(F.linear(x, self.quantized_weight(), self.bias))


def _grad_scale(x: torch.Tensor, quant_max: int) -> float:
    """LSQ's gradient scale for a step size, 1 / sqrt(values quantized with it x the largest
    level): it keeps the step sizes' gradients on the weights' scale, so that clipping the
    gradient norm of the whole model does not shrink the weights' gradients whenever a range
    gradient is large."""
    return 1.0 / math.sqrt(max(x.numel(), 1) * max(abs(quant_max), 1))


class _LearnedScale(FakeQuantizeBase):
    """A fake quant whose scale (per tensor or per channel) is its calibrated one times
    ``exp(log_gain)``, the gain a trained parameter starting at exactly 0."""

    base_scale: torch.Tensor

    def _init_scale(self, scale: torch.Tensor) -> None:
        self.register_buffer("base_scale", scale.detach().float().clone())
        self.log_gain = nn.Parameter(torch.zeros(len(scale)))

    def _scale(self) -> torch.Tensor:
        return self.base_scale * self.log_gain.exp()

    @property
    def scale(self) -> torch.Tensor:
        return self._scale().detach()

    def _zero_points(self) -> torch.Tensor:
        raise NotImplementedError

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return self.scale, self._zero_points()

    def _learning(self) -> bool:
        return torch.is_grad_enabled() and self.log_gain.requires_grad


class LearnedRange(_LearnedScale):
    """Per-tensor affine fake quantization of an activation whose scale is trained with the
    model (LSQ, Esser et al. 2020), through torch's LSQ kernel
    (``torch._fake_quantize_learnable_per_tensor_affine``: the straight-through estimator
    through the rounding, the exact gradient through the clamp and the rescale; the forward is
    ``fake_quantize_per_tensor_affine``'s, bit for bit). The scale is the calibrated one times ``exp(log_gain)``,
    the gain starting at exactly 1: an optimizer step changes the scale by a share of itself,
    whatever the activation's magnitude, and at the start the module computes bit for bit what
    the calibrated fake quant computed. The zero point stays where the calibration put it. Under
    ``torch.no_grad`` (evaluation, export) it runs ``fake_quantize_per_tensor_affine`` with the
    current scale, the op the QDQ export writes."""

    def __init__(
        self,
        scale: float,
        zero_point: int,
        quant_min: int,
        quant_max: int,
        learn_zero_point: bool = False,
    ) -> None:
        super().__init__()
        self._init_scale(torch.tensor([scale], dtype=torch.float32))
        # the offset in quantization steps (LSQ+): rounded to the integer zero point it deploys
        self.offset = nn.Parameter(torch.tensor([float(zero_point)]), learn_zero_point)
        self.quant_min, self.quant_max = quant_min, quant_max
        self.dtype, self.qscheme = torch.quint8, torch.per_tensor_affine

    @property
    def zero_point(self) -> torch.Tensor:
        zp = self.offset.detach().round().clamp(self.quant_min, self.quant_max)
        return zp.to(torch.int32)

    def _zero_points(self) -> torch.Tensor:
        return self.zero_point

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(self.fake_quant_enabled[0]):
            return x
        if not self._learning():
            return torch.fake_quantize_per_tensor_affine(
                x, self.scale, self.zero_point, self.quant_min, self.quant_max
            )
        return torch._fake_quantize_learnable_per_tensor_affine(
            x,
            self._scale(),
            self.offset,
            self.quant_min,
            self.quant_max,
            _grad_scale(x, self.quant_max),
        )


class LearnedWeightRange(_LearnedScale):
    """Per-channel symmetric fake quantization of a weight (output channels on axis 0) whose
    scales are trained with the model, as :class:`LearnedRange` (a gain per channel, LSQ
    gradient)."""

    zero_point: torch.Tensor

    def __init__(self, scale: torch.Tensor, quant_min: int, quant_max: int) -> None:
        super().__init__()
        self._init_scale(scale)
        self.register_buffer("zero_point", torch.zeros(len(scale), dtype=torch.int32))
        self.quant_min, self.quant_max, self.ch_axis = quant_min, quant_max, 0
        self.dtype, self.qscheme = torch.qint8, torch.per_channel_symmetric

    def _zero_points(self) -> torch.Tensor:
        return self.zero_point

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if not bool(self.fake_quant_enabled[0]):
            return w
        if not self._learning():
            return torch.fake_quantize_per_channel_affine(
                w, self.scale, self.zero_point, 0, self.quant_min, self.quant_max
            )
        zp = self.zero_point.float()
        return torch._fake_quantize_learnable_per_channel_affine(
            w,
            self._scale(),
            zp,
            0,
            self.quant_min,
            self.quant_max,
            _grad_scale(w[0], self.quant_max),
        )


# -- INT32 biases in training ------------------------------------------------------------------
def on_int32_grid(
    bias: torch.Tensor, input_scale: float | torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """``bias`` rounded to ONNX Runtime's INT32 bias grid: input scale x each output channel's
    weight scale (in double, then back to float)."""
    grid = (torch.as_tensor(input_scale).double() * weight_scale.double()).clamp_min(1e-30)
    return (torch.round(bias.double() / grid) * grid).float()


def _effective_bias(layer: nn.Module) -> torch.Tensor:
    """The bias the deployed layer adds: its own, or for a fused Conv-BN the folded one."""
    weight: torch.Tensor = layer.weight  # type: ignore[assignment]
    own = layer.bias if isinstance(layer.bias, torch.Tensor) else torch.zeros(weight.shape[0])
    bn = getattr(layer, "bn", None)
    if bn is None:
        return own.detach()
    factor = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    folded: torch.Tensor = (bn.bias + (own - bn.running_mean) * factor).detach()
    return folded


def bias_rounding(layer: nn.Module) -> torch.Tensor | None:
    """What rounding ``layer``'s bias to ONNX Runtime's INT32 grid (input scale x each
    channel's weight scale) adds to each output channel, or None where the layer runs without
    it (its input or weight not fake-quantized). A constant of the forward pass: no gradient."""
    src = layer.__dict__.get("_bias_input")
    wfq = getattr(layer, "weight_fake_quant", None)
    if not src or wfq is None or not bool(wfq.fake_quant_enabled[0]):
        return None
    fq = src[0]
    if not bool(fq.fake_quant_enabled[0]) or fq.scale.numel() != 1:
        return None
    with torch.no_grad():
        b = _effective_bias(layer)
        return on_int32_grid(b, fq.scale.reshape(()), wfq.scale) - b


def _plus(out: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    if delta is None:
        return out
    return out + delta.reshape(1, -1, *([1] * (out.dim() - 2)))


class _Conv2d(nnqat.Conv2d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _plus(super().forward(input), bias_rounding(self))  # type: ignore[no-untyped-call]


class _ConvReLU2d(nniqat.ConvReLU2d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        w = self.weight_fake_quant(self.weight)
        return F.relu(_plus(self._conv_forward(input, w, self.bias), bias_rounding(self)))


class _ConvBn2d(nniqat.ConvBn2d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _plus(self._forward(input), bias_rounding(self))  # type: ignore[no-untyped-call]


class _ConvBnReLU2d(nniqat.ConvBnReLU2d):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.relu(_plus(self._forward(input), bias_rounding(self)))  # type: ignore[no-untyped-call]


class _Linear(nnqat.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _plus(super().forward(input), bias_rounding(self))  # type: ignore[no-untyped-call]


# QAT layer classes and their twins that add the INT32 bias rounding before the activation
BIAS_TWINS: dict[type, type] = {
    nnqat.Conv2d: _Conv2d,
    nniqat.ConvReLU2d: _ConvReLU2d,
    nniqat.ConvBn2d: _ConvBn2d,
    nniqat.ConvBnReLU2d: _ConvBnReLU2d,
    nnqat.Linear: _Linear,
}
