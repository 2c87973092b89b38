"""Which batches fine-tuning reads: the task's training data or its calibration inputs
(:func:`resolve_data`), the leading ones held out to judge it (:func:`held_out_batches`), the
rest cycled (:func:`batch_stream`), and padded text batches cut to their longest row
(:func:`trim_padding`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import DataError
from ..signature import n_rows

if TYPE_CHECKING:
    from ..task import Task

__all__ = [
    "Batches",
    "DataSettings",
    "batch_stream",
    "held_out_batches",
    "resolve_data",
    "trim_padding",
]


class DataSettings(Protocol):
    """What of :class:`.finetune.FinetuneConfig` this module reads."""

    @property
    def data(self) -> str: ...

    @property
    def val_batches(self) -> int: ...

    @property
    def min_val_rows(self) -> int: ...


Batches = Callable[[], Iterable[tuple[dict[str, np.ndarray], Any]]]


def resolve_data(task: Task, cfg: DataSettings) -> tuple[Batches, str, str | None]:
    """(batches, source, note): which data fine-tuning uses, and a note when it fell back."""
    if cfg.data == "train" and task.train_data is None:
        raise DataError(
            f"task {task.name} has no train_data(), but fine-tuning asks for `data: train`; "
            "define train_data() in the task, or set `data: calibration` to distil on "
            "calibration inputs"
        )
    if cfg.data != "calibration" and task.train_data is not None:
        return task.train_data, "train", None
    calib = task.calibration_data

    def unlabelled() -> Iterator[tuple[dict[str, np.ndarray], Any]]:
        for inputs in calib():
            yield inputs, None

    note = None
    if cfg.data == "auto":
        note = (
            f"task {task.name} has no train_data(); fine-tuning distils from the FP32 teacher "
            "on calibration inputs instead"
        )
    return unlabelled, "calibration", note


def trim_padding(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Drop trailing sequence positions that are padding in every row (``attention_mask`` 0).

    Applies to padded text batches only: an ``attention_mask`` of shape ``[N, L]``; every input of
    that shape is cut to the longest row. For an encoder that honours its mask (BERT-class models)
    the outputs at the kept positions do not change; training is faster by the padding share.
    """
    mask = inputs.get("attention_mask")
    if mask is None or mask.ndim != 2 or not mask.any():
        return inputs
    length = int(np.flatnonzero(mask.any(axis=0)).max()) + 1
    if length == mask.shape[1]:
        return inputs
    return {k: (v[:, :length] if v.shape[:2] == mask.shape else v) for k, v in inputs.items()}


def batch_stream(batches: Batches, skip: int) -> Iterator[tuple[dict[str, np.ndarray], Any]]:
    """Cycle through ``batches()`` forever, skipping the first ``skip`` (held out)."""
    while True:
        seen = 0
        for i, item in enumerate(batches()):
            if i < skip:
                continue
            seen += 1
            yield item
        if seen == 0:
            return


def _item_rows(item: Any) -> int | None:
    """Rows of a batch of ``(inputs, labels)``; None where its inputs are not named arrays."""
    inputs = item[0] if isinstance(item, tuple) else item
    return n_rows(inputs) if isinstance(inputs, dict) and inputs else None


def held_out_batches(batches: Batches, cfg: DataSettings) -> tuple[list[Any], int]:
    """The held-out batches and how many leading batches training skips: the first
    ``val_batches``, or more where they hold fewer than ``min_val_rows`` rows and the data has
    more batches than twice that many (the rest train); with too little data to hold any out,
    half of it, trained on too."""
    want = cfg.val_batches
    items: list[Any] = []
    for item in batches():
        items.append(item)
        rows = _item_rows(item) if len(items) == 1 and cfg.min_val_rows else None
        if rows:
            want = max(want, -(-cfg.min_val_rows // rows))
        if len(items) > 2 * want:
            break
    if not items:
        raise DataError(
            "fine-tuning data yielded no batches; train_data()/calibration_data() is empty"
        )
    if len(items) > 2 * want:
        return items[:want], want
    if len(items) > cfg.val_batches:
        return items[: cfg.val_batches], cfg.val_batches
    return items[: max(1, len(items) // 2)], 0  # validate on what it trains on
