"""Tensor helpers shared by every layer: the inputs type and the checks on it (a leaf module)."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputMismatchError
from .signature import Signature, batch_axis, concat_rows, n_rows, slice_rows

__all__ = [
    "FROZEN_KEY",
    "FROZEN_RT_INFO",
    "Inputs",
    "check_inputs",
    "drop_frozen",
    "frozen_from_json",
    "frozen_inputs",
    "frozen_to_json",
    "same_value",
    "take_samples",
]

Inputs = dict[str, np.ndarray]

# an ONNX metadata_props key: the inputs frozen into constants (the recipe's constant_inputs),
# as JSON {name: {"dtype": ..., "value": ...}}, so a file served alone says what it was built for
FROZEN_KEY = "slimline.constant_inputs"
FROZEN_RT_INFO = "slimline_constant_inputs"  # the same, in an OpenVINO IR's rt_info


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


def frozen_to_json(frozen: Mapping[str, np.ndarray]) -> str:
    return json.dumps(
        {k: {"dtype": str(v.dtype), "value": v.tolist()} for k, v in sorted(frozen.items())}
    )


def frozen_from_json(text: str | None) -> dict[str, np.ndarray]:
    """The frozen inputs a file's :data:`FROZEN_KEY` entry records (``{}`` for none)."""
    if not text:
        return {}
    return {k: np.asarray(v["value"], dtype=v["dtype"]) for k, v in json.loads(text).items()}


def frozen_inputs(path: Path | str) -> dict[str, np.ndarray]:
    """The inputs an ONNX file (or an OpenVINO IR, in its ``rt_info`` entry
    :data:`FROZEN_RT_INFO`) was frozen for."""
    path = Path(path)
    if path.suffix == ".xml":
        # the model's rt_info is an element of the IR's XML (the weights are in the .bin):
        # reading it does not need OpenVINO to load the model
        import xml.etree.ElementTree as ET

        entry = ET.parse(path).getroot().find(f"rt_info/{FROZEN_RT_INFO}")
        return frozen_from_json(entry.get("value") if entry is not None else None)
    import mmap

    if path.stat().st_size == 0:  # not a model: its loader says so
        return {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as raw:
        if raw.find(FROZEN_KEY.encode()) < 0:  # most files: no need to parse the graph
            return {}
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return frozen_from_json(
        next((p.value for p in model.metadata_props if p.key == FROZEN_KEY), None)
    )


def same_value(got: np.ndarray, frozen: np.ndarray) -> bool:
    """Whether a fed array is the frozen value: equal elementwise, in any numeric dtype, with the
    frozen shape or the same number of elements (``[16000]`` for a scalar)."""
    got = np.asarray(got)
    return got.size == frozen.size and bool(np.array_equal(got.reshape(frozen.shape), frozen))


def drop_frozen(
    inputs: Mapping[str, np.ndarray],
    takes: Collection[str],
    frozen: Mapping[str, np.ndarray],
    where: str,
) -> Inputs:
    """``inputs`` without those a model no longer takes because they were frozen into it (the
    task's samples still carry them). A frozen input fed a different value raises
    :class:`InputMismatchError` naming the input and the value the model was built for."""
    out: Inputs = {}
    for name, arr in inputs.items():
        if name in takes or name not in frozen:
            out[name] = arr
        elif not same_value(arr, frozen[name]):
            raise InputMismatchError(
                f"{where}: input {name!r} was frozen to {frozen[name].tolist()} (the recipe's "
                f"constant_inputs) but is fed {np.asarray(arr).tolist()!s:.80}; send "
                f"{frozen[name].tolist()} or leave the input out"
            )
    return out
