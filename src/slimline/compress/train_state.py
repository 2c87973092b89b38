"""What a distillation run keeps between its steps: early stopping on the held-out loss (the
best weights so far), and the checkpoint of the whole training state that a killed run resumes
from (:func:`slimline.compress.finetune.distill` writes it at every held-out evaluation)."""

from __future__ import annotations

import copy
import io
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..record import atomic_write_bytes

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import nn

__all__ = ["EarlyStopping", "FileCheckpoint", "TrainCheckpoint"]

log = logging.getLogger("slimline.compress.finetune")


class TrainCheckpoint(Protocol):
    """Where :func:`distill` keeps its training state, so that a killed run resumes mid-way.

    ``load`` returns what the last ``save`` stored (or ``None``); ``save`` must be atomic."""

    def load(self) -> dict[str, Any] | None: ...

    def save(self, state: dict[str, Any]) -> None: ...


class FileCheckpoint:
    """A :class:`TrainCheckpoint` in one file: ``torch.save`` written atomically, read back with
    ``weights_only=True``; ``what`` names the training in the resume message."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what

    def load(self) -> dict[str, Any] | None:
        import torch

        if not self.path.is_file():
            return None
        state: dict[str, Any] = torch.load(self.path, weights_only=True)
        log.info("%s: continuing at step %d from %s", self.what, state["step"], self.path)
        return state

    def save(self, state: dict[str, Any]) -> None:
        import torch

        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write_bytes(self.path, buf.getvalue())


class EarlyStopping:
    """The best held-out loss so far, its weights and step, and the evaluations since it last
    improved by more than ``min_delta`` (relative). :meth:`update` says when ``patience`` such
    evaluations have passed."""

    def __init__(self, student: nn.Module, loss: float, min_delta: float, patience: int) -> None:
        self.best, self.state = loss, copy.deepcopy(student.state_dict())
        self.step, self.bad = 0, 0
        self.min_delta, self.patience = min_delta, patience

    def update(self, step: int, loss: float, student: nn.Module) -> bool:
        """Record the held-out ``loss`` of ``student`` after ``step``; True: stop training."""
        if loss < self.best * (1.0 - self.min_delta):
            self.best, self.state = loss, copy.deepcopy(student.state_dict())
            self.step, self.bad = step, 0
            return False
        self.bad += 1
        return self.bad >= self.patience
