"""The re-parameterized depthwise CNN of the ``mnist-rep`` example (kept apart so the task module
imports cheaply): PP-LCNetV3 / MobileOne-style blocks, trained with parallel branches and
deployed with each block's branches folded into one convolution."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["Affine", "RepBlock", "RepConv", "RepDepthwiseCNN", "SqueezeExcite"]


class Affine(nn.Module):
    """PP-LCNetV3's learnable affine block: ``scale * x + bias`` with two scalars."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x + self.bias


class SqueezeExcite(nn.Module):
    """MobileNetV3's squeeze-and-excite: a per-channel hard-sigmoid gate from pooled features."""

    def __init__(self, channels: int, reduction: int = 4) -> None:
        super().__init__()
        self.gate = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(channels, channels // reduction, 1),
            nn.ReLU(),
            nn.Conv2d(channels // reduction, channels, 1),
            nn.Hardsigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate: torch.Tensor = self.gate(x)
        return x * gate


def _fold_bn(weight: torch.Tensor, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    assert bn.running_var is not None and bn.running_mean is not None
    factor = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    return weight * factor.reshape(-1, 1, 1, 1), bn.bias - bn.running_mean * factor


class RepConv(nn.Module):
    """Training form of one re-parameterizable convolution: a ``kernel`` x ``kernel`` conv with
    BatchNorm, plus a 1x1 conv with BatchNorm (when ``kernel`` > 1), plus a BatchNorm of the
    input itself (when the shape is kept), summed. :meth:`fused` folds the three into one
    convolution with a bias that computes the same function in eval mode."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, groups: int) -> None:
        super().__init__()
        self.kernel, self.stride, self.groups = kernel, stride, groups
        self.conv = nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.conv1: nn.Conv2d | None = None
        self.bn1: nn.BatchNorm2d | None = None
        if kernel > 1:
            self.conv1 = nn.Conv2d(cin, cout, 1, stride, 0, groups=groups, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
        self.identity = nn.BatchNorm2d(cout) if stride == 1 and cin == cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.bn(self.conv(x))
        if self.conv1 is not None and self.bn1 is not None:
            y = y + self.bn1(self.conv1(x))
        if self.identity is not None:
            y = y + self.identity(x)
        return y

    @torch.no_grad()
    def fused(self) -> nn.Conv2d:
        weight, bias = _fold_bn(self.conv.weight, self.bn)
        pad = self.kernel // 2
        if self.conv1 is not None and self.bn1 is not None:
            w1, b1 = _fold_bn(self.conv1.weight, self.bn1)
            weight, bias = weight + nn.functional.pad(w1, [pad] * 4), bias + b1
        if self.identity is not None:
            eye = torch.zeros_like(self.conv.weight)
            per_group = eye.shape[1]
            for channel in range(eye.shape[0]):
                eye[channel, channel % per_group, pad, pad] = 1.0
            wi, bi = _fold_bn(eye, self.identity)
            weight, bias = weight + wi, bias + bi
        c = self.conv
        out = nn.Conv2d(
            c.in_channels, c.out_channels, self.kernel, self.stride, pad, groups=self.groups
        )
        out.weight.copy_(weight)
        assert out.bias is not None
        out.bias.copy_(bias)
        return out


class RepBlock(nn.Module):
    """Depthwise ``kernel`` x ``kernel`` (re-parameterizable, no BatchNorm after folding),
    hard-swish, affine, optional squeeze-and-excite, then the same for the 1x1 pointwise conv."""

    def __init__(self, cin: int, cout: int, stride: int, kernel: int, se: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = [RepConv(cin, cin, kernel, stride, cin), nn.Hardswish(), Affine()]
        if se:
            layers.append(SqueezeExcite(cin))
        layers += [RepConv(cin, cout, 1, 1, 1), nn.Hardswish(), Affine()]
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


class RepDepthwiseCNN(nn.Module):
    """Stem (3x3 stride 2, BatchNorm, hard-swish), ``RepBlock`` s given as
    ``(width, stride, kernel, squeeze_excite)``, global average pooling, a 1x1 head with
    hard-swish and a linear classifier: ``x [N, 1, H, W] -> logits [N, classes]``."""

    def __init__(
        self,
        stem: int,
        blocks: Sequence[tuple[int, int, int, bool]],
        head: int,
        classes: int = 10,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, stem, 3, 2, 1, bias=False), nn.BatchNorm2d(stem), nn.Hardswish()
        )
        layers: list[nn.Module] = []
        cin = stem
        for width, stride, kernel, se in blocks:
            layers.append(RepBlock(cin, width, stride, kernel, se))
            cin = width
        self.blocks = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Conv2d(cin, head, 1), nn.Hardswish())
        self.fc = nn.Linear(head, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(self.pool(self.blocks(self.stem(x))))
        out: torch.Tensor = self.fc(torch.flatten(y, 1))
        return out

    def fuse(self) -> RepDepthwiseCNN:
        """Fold every ``RepConv`` into one convolution (in place; call in eval mode): the
        deployed form."""
        for block in self.blocks:
            assert isinstance(block, RepBlock)
            for i, layer in enumerate(block.body):
                if isinstance(layer, RepConv):
                    block.body[i] = layer.fused()
        return self
