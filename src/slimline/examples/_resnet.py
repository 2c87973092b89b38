"""The residual CNN of the ``mnist`` example (kept apart so the task module imports cheaply)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["BasicBlock", "ResidualCNN"]


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus a shortcut (1x1 conv + BN where the shape changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        out: torch.Tensor = self.relu(self.bn2(self.conv2(y)) + self.shortcut(x))
        return out


class ResidualCNN(nn.Module):
    """Stride-2 stem, stages of basic blocks (each later stage halves the resolution), global
    average pooling and a linear head: ``x [N, 1, H, W] -> logits [N, classes]``."""

    def __init__(
        self, stem: int, widths: Sequence[int], blocks: Sequence[int], classes: int = 10
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, stem, 3, 2, 1, bias=False), nn.BatchNorm2d(stem), nn.ReLU()
        )
        layers: list[nn.Module] = []
        cin = stem
        for stage, (width, n) in enumerate(zip(widths, blocks, strict=True)):
            for j in range(n):
                layers.append(BasicBlock(cin, width, 2 if stage > 0 and j == 0 else 1))
                cin = width
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))
        return out
