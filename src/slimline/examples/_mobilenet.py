"""The depthwise-separable CNN of the ``mnist-dw`` example (kept apart so the task module imports
cheaply): MobileNetV2-style inverted residual blocks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["DepthwiseCNN", "InvertedResidual"]


def _conv_bn(
    cin: int, cout: int, kernel: int, stride: int, groups: int = 1, bn: bool = True
) -> list[nn.Module]:
    pad = kernel // 2
    conv = nn.Conv2d(cin, cout, kernel, stride, pad, groups=groups, bias=not bn)
    return [conv, nn.BatchNorm2d(cout)] if bn else [conv]


class InvertedResidual(nn.Module):
    """1x1 expansion (BN, ReLU), 3x3 depthwise (BN unless ``dw_bn`` is false, ReLU), 1x1 linear
    projection (BN unless ``dw_bn`` is false, no activation), plus the input where the shape is
    kept. Plain ReLU, not ReLU6: the activations
    after the depthwise layers are unbounded, as in many MobileNet-style models trained without
    quantization in mind."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int, dw_bn: bool = True) -> None:
        super().__init__()
        hidden = cin * expand
        self.block = nn.Sequential(
            *_conv_bn(cin, hidden, 1, 1),
            nn.ReLU(),
            *_conv_bn(hidden, hidden, 3, stride, groups=hidden, bn=dw_bn),
            nn.ReLU(),
            *_conv_bn(hidden, cout, 1, 1, bn=dw_bn),
        )
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.block(x)
        return x + y if self.residual else y


class DepthwiseCNN(nn.Module):
    """A stride-2 3x3 stem, stages of inverted residual blocks (the first block of a stage strides by 2
    except in the first stage), a 1x1 head convolution, global average pooling and a linear
    classifier: ``x [N, 1, H, W] -> logits [N, classes]``."""

    def __init__(
        self,
        stem: int,
        widths: Sequence[int],
        blocks: Sequence[int],
        expand: int,
        head: int,
        classes: int = 10,
        dw_bn: bool = True,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(1, stem, 3, 2), nn.ReLU())
        layers: list[nn.Module] = []
        cin = stem
        for stage, (width, n) in enumerate(zip(widths, blocks, strict=True)):
            for j in range(n):
                stride = 2 if stage > 0 and j == 0 else 1
                layers.append(InvertedResidual(cin, width, stride, expand, dw_bn))
                cin = width
        self.layers = nn.Sequential(*layers)
        self.head = nn.Sequential(*_conv_bn(cin, head, 1, 1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(head, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(self.layers(self.stem(x)))
        out: torch.Tensor = self.fc(torch.flatten(self.pool(y), 1))
        return out
