"""Where the batch is in a model's inputs and outputs, and how to cut and join rows along it.

PyTorch tasks put the batch on axis 0 of every input and return one output; that is the
default (``sig=None``). An ONNX model may not: a recurrent state ``[2, batch, 128]`` holds it on
axis 1, a sample rate ``[]`` has none (it is passed whole to every call), and a model exported
with a fixed batch of 1 takes one row per call. A :class:`Signature` records that, once per
task, and every function here that slices, joins or tiles rows reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Dim",
    "ModelInput",
    "Signature",
    "batch_axis",
    "concat_outputs",
    "concat_rows",
    "n_rows",
    "rows_first",
    "shown",
    "slice_rows",
    "split_rows",
    "tile_rows",
]

Arrays = Mapping[str, np.ndarray]


Dim = int | str | None  # a fixed size, a named free dim, an unnamed free dim


@dataclass(frozen=True)
class ModelInput:
    dtype: str
    dims: list[Dim]


@dataclass(frozen=True)
class Signature:
    """Batch axis of each input and output (``None``: the array has no batch axis)."""

    inputs: dict[str, int | None]
    outputs: dict[str, int | None] = field(default_factory=dict)
    max_batch: int | None = None  # 1: the model takes one row per call (rows are fed in turn)
    primary: str | None = None  # the output the task metric reads; default: the first

    def to_dict(self) -> dict[str, object]:
        return {
            "inputs": {k: {"batch_axis": v} for k, v in self.inputs.items()},
            "outputs": {k: {"batch_axis": v} for k, v in self.outputs.items()},
            "max_batch": self.max_batch,
            "primary_output": self.primary_output,
        }

    @property
    def primary_output(self) -> str | None:
        return self.primary or next(iter(self.outputs), None)

    def allows(self, batch: int) -> bool:
        return self.max_batch is None or batch <= self.max_batch


def shown(model: ModelInput, axis: int | None) -> str:
    """``float32 [2, batch, 128]``: the model's shape with its batch axis named ``batch``."""
    if not model.dims:
        return f"{model.dtype} scalar"
    dims = [
        "batch" if a == axis else ("?" if d is None else str(d)) for a, d in enumerate(model.dims)
    ]
    return f"{model.dtype} [{', '.join(dims)}]"


def batch_axis(sig: Signature | None, name: str) -> int | None:
    return 0 if sig is None else sig.inputs.get(name, 0)


def _output_axis(sig: Signature | None, name: str) -> int | None:
    return 0 if sig is None else sig.outputs.get(name, 0)


def n_rows(inputs: Arrays, sig: Signature | None = None) -> int:
    """Rows in a batch: the length of the first input that has a batch axis."""
    for name, arr in inputs.items():
        axis = batch_axis(sig, name)
        if axis is not None:
            return int(arr.shape[axis])
    raise ValueError("no input has a batch axis")


def slice_rows(
    inputs: Arrays, start: int, stop: int, sig: Signature | None = None
) -> dict[str, np.ndarray]:
    """Rows ``start:stop`` of every batched input; inputs without a batch axis pass whole."""
    out = {}
    for name, arr in inputs.items():
        axis = batch_axis(sig, name)
        if axis is None:
            out[name] = arr
        else:
            index = [slice(None)] * arr.ndim
            index[axis] = slice(start, stop)
            out[name] = arr[tuple(index)]
    return out


def concat_rows(parts: Sequence[Arrays], sig: Signature | None = None) -> dict[str, np.ndarray]:
    """Join batches along their batch axes; inputs without one are taken from the first batch."""
    if len(parts) == 1:
        return dict(parts[0])
    out = {}
    for name in parts[0]:
        axis = batch_axis(sig, name)
        out[name] = (
            parts[0][name] if axis is None else np.concatenate([p[name] for p in parts], axis=axis)
        )
    return out


def split_rows(
    inputs: Arrays, size: int, sig: Signature | None = None
) -> Iterator[dict[str, np.ndarray]]:
    n = n_rows(inputs, sig)
    for start in range(0, n, size):
        yield slice_rows(inputs, start, min(start + size, n), sig)


def tile_rows(inputs: Arrays, batch: int, sig: Signature | None = None) -> dict[str, np.ndarray]:
    """A batch of exactly ``batch`` rows, repeating the rows of ``inputs`` if it has fewer."""
    n = n_rows(inputs, sig)
    reps = -(-batch // n)
    return slice_rows(concat_rows([inputs] * reps, sig), 0, batch, sig)


def concat_outputs(
    parts: Sequence[Arrays], sig: Signature | None = None, *, stack_unbatched: bool = True
) -> dict[str, np.ndarray]:
    """Join per-call outputs along each output's batch axis. An output without one is stacked
    (one entry per call) or, with ``stack_unbatched=False``, taken from the last call."""
    out = {}
    for name in parts[0]:
        axis = _output_axis(sig, name)
        arrays = [p[name] for p in parts]
        if axis is not None:
            out[name] = np.concatenate(arrays, axis=axis)
        else:
            out[name] = np.stack(arrays) if stack_unbatched else arrays[-1]
    return out


def rows_first(outputs: Arrays, sig: Signature | None = None) -> dict[str, np.ndarray]:
    """Outputs with their batch axis moved to the front, so row ``i`` is ``out[i]``."""
    out = {}
    for name, arr in outputs.items():
        axis = _output_axis(sig, name)
        out[name] = arr if axis in (None, 0) else np.moveaxis(arr, axis, 0)
    return out
