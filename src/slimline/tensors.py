"""Tensor helpers shared by every layer: the inputs type and the checks on it (a leaf module)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .errors import InputMismatchError
from .signature import Signature, batch_axis, concat_rows, n_rows, slice_rows

__all__ = ["Inputs", "check_inputs", "take_samples"]

Inputs = dict[str, np.ndarray]


def take_samples(batches: Iterable[Inputs], n: int, sig: Signature | None = None) -> Inputs:
    """Concatenate batches (along their batch axes) until ``n`` rows are collected; returns
    ``{}`` for no data."""
    parts: list[Inputs] = []
    have = 0
    for b in batches:
        parts.append(b)
        have += n_rows(b, sig)
        if have >= n:
            break
    if not parts:
        return {}
    return slice_rows(concat_rows(parts, sig), 0, n, sig)


def check_inputs(
    inputs: Inputs,
    expected: dict[str, tuple[str, list[Any]]],
    where: str,
    sig: Signature | None = None,
) -> None:
    """Check names, dtypes and ranks/static dims of ``inputs`` against a model's input spec.

    ``expected`` maps input name -> (numpy dtype name, shape with ints for fixed dims and
    str/None for free dims). The batch axis of a model with a fixed batch of 1 may hold more
    rows when ``sig`` says it takes rows in turn.
    """
    got, want = set(inputs), set(expected)
    if got != want:
        raise InputMismatchError(
            f"{where}: inputs are named {sorted(got)} but the model expects {sorted(want)}; "
            "rename the arrays to the model's input names"
        )
    for name, (dtype, shape) in expected.items():
        arr = inputs[name]
        if str(arr.dtype) != dtype:
            raise InputMismatchError(
                f"{where}: input {name!r} is {arr.dtype} but the model expects {dtype}; "
                f"convert it with .astype(np.{dtype})"
            )
        rows_axis = batch_axis(sig, name) if sig is not None and sig.max_batch == 1 else None
        if arr.ndim != len(shape) or any(
            isinstance(d, int) and d != s and a != rows_axis
            for a, (d, s) in enumerate(zip(shape, arr.shape, strict=False))
        ):
            shown = ["?" if not isinstance(d, int) else d for d in shape]
            raise InputMismatchError(
                f"{where}: input {name!r} has shape {list(arr.shape)} but the model expects {shown}; "
                "reshape the samples to match"
            )
