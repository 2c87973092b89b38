"""Sentence embedding head of the ``minilm`` example (kept apart so the task imports cheaply)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SentenceEncoder"]


class SentenceEncoder(nn.Module):
    """A Hugging Face encoder plus sentence-transformers' pooling: the mean of the last hidden
    states over the attention mask, L2-normalised. ``forward(input_ids, attention_mask)`` ->
    ``[N, hidden]``."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2.0, dim=1)
