"""The modules a QAT model is exported through (kept apart: importing them imports torch)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization import FakeQuantizeBase

__all__ = ["ONNX_INT8", "LearnedRange", "LearnedWeightRange", "QConv2d", "QLinear"]

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


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest (ties to even, as ``fake_quantize_per_tensor_affine``) with the
    straight-through gradient."""
    return x + (torch.round(x) - x).detach()


class LearnedRange(FakeQuantizeBase):
    """Per-tensor affine fake quantization of an activation whose scale is trained with the
    model (LSQ, Esser et al. 2020: the straight-through estimator through the rounding, the
    exact gradient through the clamp and the rescale). The scale is kept as its logarithm, so an
    optimizer step changes it by a share of itself, whatever the activation's magnitude; the
    zero point stays where the calibration put it. Under ``torch.no_grad`` (evaluation, export)
    it runs ``fake_quantize_per_tensor_affine`` with the current scale, the op the QDQ export
    writes."""

    zero_point: torch.Tensor

    def __init__(self, scale: float, zero_point: int, quant_min: int, quant_max: int) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(scale)))
        self.register_buffer("zero_point", torch.tensor([zero_point], dtype=torch.int32))
        self.quant_min, self.quant_max = quant_min, quant_max
        self.dtype, self.qscheme = torch.quint8, torch.per_tensor_affine

    @property
    def scale(self) -> torch.Tensor:
        return self.log_scale.detach().exp().reshape(1)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return self.scale, self.zero_point

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(self.fake_quant_enabled[0]):
            return x
        if not (torch.is_grad_enabled() and self.log_scale.requires_grad):
            return torch.fake_quantize_per_tensor_affine(
                x, self.scale, self.zero_point, self.quant_min, self.quant_max
            )
        s, zp = self.log_scale.exp(), self.zero_point.float()
        q = torch.clamp(_round_ste(x / s) + zp, self.quant_min, self.quant_max)
        return (q - zp) * s


class LearnedWeightRange(FakeQuantizeBase):
    """Per-channel symmetric fake quantization of a weight (output channels on axis 0) whose
    scales are trained with the model, as :class:`LearnedRange` (log-scales, LSQ gradient)."""

    zero_point: torch.Tensor

    def __init__(self, scale: torch.Tensor, quant_min: int, quant_max: int) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(scale.detach().float().clamp_min(1e-12).log())
        self.register_buffer("zero_point", torch.zeros(len(scale), dtype=torch.int32))
        self.quant_min, self.quant_max, self.ch_axis = quant_min, quant_max, 0
        self.dtype, self.qscheme = torch.qint8, torch.per_channel_symmetric

    @property
    def scale(self) -> torch.Tensor:
        return self.log_scale.detach().exp()

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return self.scale, self.zero_point

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if not bool(self.fake_quant_enabled[0]):
            return w
        if not (torch.is_grad_enabled() and self.log_scale.requires_grad):
            return torch.fake_quantize_per_channel_affine(
                w, self.scale, self.zero_point, 0, self.quant_min, self.quant_max
            )
        s = self.log_scale.exp().reshape(-1, *([1] * (w.dim() - 1)))
        return torch.clamp(_round_ste(w / s), self.quant_min, self.quant_max) * s
