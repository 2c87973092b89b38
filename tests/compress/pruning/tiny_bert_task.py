"""A tiny sentence-encoder task for depth-pruning tests: a 4-layer BertModel built from a
``transformers`` config (seeded random weights), mean-pooled and L2-normalised like minilm.
The metric is the mean cosine of the embeddings to labels taken from the model itself, so the
unpruned model scores 1.0 and a pruned one less."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

import numpy as np
import torch
from torch import nn

NAME = "tiny-bert"
METRIC_NAME = "cosine"
OUTPUT_KIND = "embedding"
SEQ = 12


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.encoder = BertModel(config, add_pooling_layer=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return nn.functional.normalize(pooled, dim=-1)


@cache
def model() -> nn.Module:
    torch.manual_seed(0)
    return Encoder().eval()


def _batch(seed: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 64, size=(n, SEQ)).astype(np.int64)
    lengths = rng.integers(4, SEQ + 1, size=n)
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int64)
    return {"input_ids": ids * mask, "attention_mask": mask}


def calibration_data() -> Iterator[dict[str, np.ndarray]]:
    for i in range(8):
        yield _batch(i, 8)


def eval_data() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    m = model()
    for i in range(2):
        x = _batch(100 + i, 8)
        with torch.no_grad():
            labels = m(**{k: torch.from_numpy(v) for k, v in x.items()}).numpy()
        yield x, labels


def metric(outputs: np.ndarray, labels: np.ndarray) -> float:
    return float((outputs * labels).sum(1).mean())
