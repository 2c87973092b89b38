"""The :class:`Task` record: a model factory, its data and its metric (see :mod:`slimline.task`).

A leaf module, so that task loaders (``task.py``, ``onnx_task.py``) and runners depend on it
without depending on each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .errors import DataError
from .signature import Signature
from .tensors import Inputs, take_samples

if TYPE_CHECKING:
    from .measure.judge import Judge

__all__ = ["OutputKind", "Task"]

OutputKind = Literal["logits", "embedding", "other"]


@dataclass
class Task:
    name: str
    source: str  # the spec it was loaded from, to reload it in a subprocess
    calibration_data: Callable[[], Iterable[Inputs]]
    eval_data: Callable[[], Iterable[tuple[Inputs, Any]]]
    metric: Callable[[np.ndarray, Any], float]
    metric_name: str = "metric"
    output_kind: OutputKind = "other"
    model: Callable[[], Any] | None = None  # torch.nn.Module factory; None for ONNX tasks
    onnx_path: Path | None = None  # set for ONNX tasks
    train_data: Callable[[], Iterable[tuple[Inputs, Any]]] | None = None
    loss: Callable[[Any, Any], Any] | None = None
    module: Any = None  # the loaded task module, for task-specific extras
    signature: Signature | None = None  # batch axes; None: axis 0 of every input, one output
    notes: list[str] = field(default_factory=list)  # how the data was used, for the report
    # the recipe's output declarations (None: every output judged by cosine)
    judge: Judge | None = None
    # a metric hook (an ONNX task's ``metric: file.py:function``): called on every output (rows
    # first, by name) and the labels instead of ``metric``; its failure rejects a candidate
    metric_hook: Callable[[dict[str, np.ndarray], Any], float] | None = None

    @property
    def is_onnx(self) -> bool:
        return self.onnx_path is not None

    @property
    def metric_is_fidelity(self) -> bool:
        """An ONNX task without a metric hook: its metric is the primary output's cosine to
        FP32, a fidelity figure (judged by the declarations where outputs are declared)."""
        return self.is_onnx and self.metric_hook is None

    def sample_inputs(self, batch: int = 1) -> Inputs:
        """The first ``batch`` rows of calibration data, for export, warm-up and benchmarks."""
        rows = take_samples(self.calibration_data(), batch, self.signature)
        if not rows:
            raise DataError(
                f"task {self.name}: calibration_data() yielded nothing; it must yield input batches"
            )
        return rows

    def extra(self, name: str, default: Any = None) -> Any:
        return getattr(self.module, name, default) if self.module is not None else default
