"""A depthwise-separable CNN (MobileNet-style blocks) at 96x96 for the runtime comparison:
synthetic seeded weights and inputs, so its figures are for speed and fidelity only. The labels
are the FP32 model's own top-1, so the metric is top-1 agreement with FP32."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

import numpy as np
import torch
from torch import nn

NAME = "depthwise"
METRIC_NAME = "top1_agreement"
OUTPUT_KIND = "logits"


def _block(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False),  # depthwise
        nn.BatchNorm2d(cin),
        nn.ReLU6(),
        nn.Conv2d(cin, cout, 1, bias=False),  # pointwise
        nn.BatchNorm2d(cout),
        nn.ReLU6(),
    )


class DepthwiseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        widths = [(32, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1)]
        self.stem = nn.Sequential(
            nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6()
        )
        self.blocks = nn.Sequential(*[_block(a, b, s) for a, b, s in widths])
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.stem(x)).mean((2, 3)))
        return out


@cache
def model() -> nn.Module:
    torch.manual_seed(0)
    net = DepthwiseNet()
    for m in net.modules():  # non-trivial BN statistics, as a trained net has
        if isinstance(m, nn.BatchNorm2d) and m.running_mean is not None:
            assert m.running_var is not None
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    return net.eval()


def _x(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 96, 96)).astype(np.float32)


def calibration_data() -> Iterator[dict[str, np.ndarray]]:
    for i in range(16):
        yield {"x": _x(i, 8)}


def eval_data() -> Iterator[tuple[dict[str, np.ndarray], Any]]:
    m = model()
    for i in range(8):
        x = _x(1000 + i, 8)
        with torch.no_grad():
            labels = m(torch.from_numpy(x)).argmax(1).numpy()
        yield {"x": x}, labels


def metric(outputs: np.ndarray, labels: np.ndarray) -> float:
    return float((outputs.argmax(1) == labels).mean())
