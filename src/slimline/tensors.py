"""Tensor helpers shared by every layer: the inputs type and the checks on it (a leaf module)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .errors import InputMismatchError

__all__ = ["Inputs", "check_inputs", "take_samples"]

Inputs = dict[str, np.ndarray]


def take_samples(batches: Iterable[Inputs], n: int) -> Inputs:
    """Concatenate batches until ``n`` rows are collected; returns ``{}`` for no data."""
    parts: list[Inputs] = []
    have = 0
    for b in batches:
        parts.append(b)
        have += len(next(iter(b.values())))
        if have >= n:
            break
    if not parts:
        return {}
    return {k: np.concatenate([p[k] for p in parts])[:n] for k in parts[0]}


def check_inputs(inputs: Inputs, expected: dict[str, tuple[str, list[Any]]], where: str) -> None:
    """Check names, dtypes and ranks/static dims of ``inputs`` against a model's input spec.

    ``expected`` maps input name -> (numpy dtype name, shape with ints for fixed dims and
    str/None for free dims).
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
        if arr.ndim != len(shape) or any(
            isinstance(d, int) and d != s for d, s in zip(shape, arr.shape, strict=False)
        ):
            shown = ["?" if not isinstance(d, int) else d for d in shape]
            raise InputMismatchError(
                f"{where}: input {name!r} has shape {list(arr.shape)} but the model expects {shown}; "
                "reshape the samples to match"
            )
