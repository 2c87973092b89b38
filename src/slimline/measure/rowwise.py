"""What every ONNX runner shares around its one runtime call: the input check (once), models
that take one row per call (fed row by row), and the primary output."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..signature import Signature, concat_outputs, n_rows, split_rows
from ..tensors import Inputs, check_inputs

__all__ = ["RowwiseRunner"]


class RowwiseRunner:
    """Base of a runner whose subclass sets ``name``, ``spec``, ``signature``, ``output_names``
    and ``_checked = False``, and implements ``call`` (one runtime call, no batching)."""

    name: str
    spec: dict[str, Any]
    signature: Signature | None
    output_names: list[str]
    _checked: bool

    def call(self, inputs: Inputs) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _check(self, inputs: Inputs) -> None:
        if not self._checked:
            check_inputs(inputs, self.spec, f"model {self.name}", self.signature)
            self._checked = True

    def _row_by_row(self, inputs: Inputs) -> bool:
        sig = self.signature
        return sig is not None and sig.max_batch == 1 and n_rows(inputs, sig) > 1

    def _primary(self) -> str:
        return (self.signature.primary_output if self.signature else None) or self.output_names[0]

    def run_all(self, inputs: Inputs) -> dict[str, np.ndarray]:
        self._check(inputs)
        if self._row_by_row(inputs):
            parts = [self.call(row) for row in split_rows(inputs, 1, self.signature)]
            return concat_outputs(parts, self.signature, stack_unbatched=False)
        return self.call(inputs)

    def run(self, inputs: Inputs) -> np.ndarray:
        """The primary output; every output is computed, as a served model computes them all."""
        self._check(inputs)
        if self._row_by_row(inputs):
            return self.run_all(inputs)[self._primary()]
        return self.call(inputs)[self._primary()]
