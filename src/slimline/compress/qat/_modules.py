"""The modules a QAT model is exported through (kept apart: importing them imports torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ONNX_INT8", "QConv2d", "QLinear"]

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
