"""The :class:`Task` record: a model factory, its data and its metric (see :mod:`slimline.task`).

A leaf module, so that task loaders (``task.py``, ``onnx_task.py``) and runners depend on it
without depending on each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .errors import DataError
from .signature import Signature
from .tensors import Inputs, drop_frozen, take_samples

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
    # the recipe's constant_inputs, checked against the model and the samples: input name ->
    # its one value (the graph step freezes them into the model)
    constant_inputs: dict[str, np.ndarray] = field(default_factory=dict)

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

    def without_inputs(self, frozen: Mapping[str, np.ndarray]) -> Task:
        """The task as a model with ``frozen`` inputs built in sees it: its data without those
        inputs (each checked to carry the frozen value), its signature without them."""
        if not frozen:
            return self

        def fit(inputs: Inputs) -> Inputs:
            return drop_frozen(inputs, (), frozen, f"task {self.name}")

        calibration, evaluation, train = self.calibration_data, self.eval_data, self.train_data
        sig = self.signature
        if sig is not None:
            sig = replace(sig, inputs={k: v for k, v in sig.inputs.items() if k not in frozen})
        return replace(
            self,
            calibration_data=lambda: (fit(b) for b in calibration()),
            eval_data=lambda: ((fit(x), y) for x, y in evaluation()),
            train_data=None if train is None else lambda: ((fit(x), y) for x, y in train()),
            signature=sig,
        )

    def extra(self, name: str, default: Any = None) -> Any:
        return getattr(self.module, name, default) if self.module is not None else default
