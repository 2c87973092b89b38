"""A small real task for pruning tests: a residual CNN trained on scikit-learn's 8x8 digits.

The weights are trained once (about two seconds, seeded) and kept in slimline's cache, so the
task file loads fast in sweep worker processes too.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from slimline.paths import cache_dir
from slimline.record import atomic_write_bytes

NAME = "digits"
METRIC_NAME = "top1"
OUTPUT_KIND = "logits"
LEARNING_RATE = 3e-3
_WEIGHTS = "digits-cnn-v1.pt"


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 32, 3, padding=1)
        self.block1 = Block(32)
        self.down = nn.Conv2d(32, 48, 3, stride=2, padding=1)
        self.block2 = Block(48)
        self.fc = nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.block1(torch.relu(self.stem(x)))
        y = self.block2(torch.relu(self.down(y)))
        return self.fc(y.mean((2, 3)))


@functools.cache
def _data() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    return x, d.target.astype(np.int64)


def _train(net: DigitsNet) -> None:
    x, y = _data()
    xt, yt = torch.from_numpy(x[:1297]), torch.from_numpy(y[:1297])
    opt = torch.optim.Adam(net.parameters(), lr=LEARNING_RATE)
    gen = torch.Generator().manual_seed(0)
    net.train()
    for _ in range(250):
        idx = torch.randint(0, len(xt), (64,), generator=gen)
        loss = nn.functional.cross_entropy(net(xt[idx]), yt[idx])
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    net.eval()


def model() -> nn.Module:
    torch.manual_seed(0)
    net = DigitsNet()
    path = cache_dir("tests") / _WEIGHTS
    if path.is_file():
        net.load_state_dict(torch.load(path, weights_only=True))
    else:
        _train(net)
        buf = io.BytesIO()
        torch.save(net.state_dict(), buf)
        atomic_write_bytes(path, buf.getvalue())
    return net.eval()


def _batches(lo: int, hi: int, size: int) -> Iterator[tuple[dict[str, np.ndarray], Any]]:
    x, y = _data()
    for i in range(lo, hi, size):
        j = min(i + size, hi)
        yield {"x": x[i:j]}, y[i:j]


def calibration_data() -> Iterator[dict[str, np.ndarray]]:
    for inputs, _ in _batches(0, 256, 64):
        yield inputs


def train_data() -> Iterator[tuple[dict[str, np.ndarray], Any]]:
    return _batches(0, 1297, 64)


def eval_data() -> Iterator[tuple[dict[str, np.ndarray], Any]]:
    return _batches(1297, 1797, 100)


def metric(outputs: np.ndarray, labels: np.ndarray) -> float:
    return float((outputs.argmax(1) == labels).mean())
