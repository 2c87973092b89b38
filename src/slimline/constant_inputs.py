"""An ONNX task's inputs that take one value in deployment (a recipe's ``constant_inputs``):
the declaration checked against the model and the samples, and the suggestion ``profile`` makes
for an input that looks constant. The graph step freezes them (:mod:`slimline.compress.freeze`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import RecipeError
from .signature import ModelInput, Signature, shown
from .taskspec import Task
from .tensors import Inputs

__all__ = ["constant_values", "suggest_constants"]


def constant_values(
    spec: Mapping[str, ModelInput],
    sig: Signature,
    declared: Mapping[str, Any],
    data: Mapping[str, Inputs],
) -> dict[str, np.ndarray]:
    """The recipe's ``constant_inputs`` as arrays of their inputs' dtypes, checked: each names
    an input without a batch axis, its value fits the input's dtype and shape, and every sample
    file (``data``: name -> arrays) carries exactly that value."""
    out: dict[str, np.ndarray] = {}
    for name, value in declared.items():
        where = f"recipe constant_inputs.{name}"
        if name not in spec:
            raise RecipeError(
                f"{where}: the model has no input {name!r} (it takes {', '.join(spec)}); fix the "
                "name"
            )
        model = spec[name]
        if sig.inputs.get(name) is not None:
            raise RecipeError(
                f"{where}: input {name!r} has a batch axis ({shown(model, sig.inputs[name])}), "
                "so it holds one value per row; only an input passed whole to every call (a "
                "sample rate, a fixed table) can be constant: remove it from constant_inputs"
            )
        out[name] = _typed(where, value, model)
        for file, arrays in data.items():
            got = arrays.get(name)
            if got is not None and not np.array_equal(got, out[name]):
                raise RecipeError(
                    f"{where}: declared {out[name].tolist()}, but samples {file} carry "
                    f"{np.asarray(got).tolist()!s:.80} for {name!r}; a constant input must take "
                    "one value in every sample: fix the value in the recipe or the samples"
                )
    return out


def suggest_constants(task: Task) -> list[str]:
    """One line per input of an ONNX task that looks constant: a scalar (or one-element)
    integer input without a batch axis, carrying one value in every calibration and evaluation
    sample, not declared yet. Only a suggestion: nothing is applied."""
    seen: dict[str, set[Any]] = {}
    rows = [*task.calibration_data(), *(x for x, _ in task.eval_data())]
    sig = task.signature
    for inputs in rows:
        for name, arr in inputs.items():
            arr = np.asarray(arr)
            whole = sig is not None and sig.inputs.get(name, 0) is None  # no rows axis
            if (
                whole
                and arr.size == 1
                and arr.dtype.kind in "iu"
                and name not in task.constant_inputs
            ):
                seen.setdefault(name, set()).add(arr.item())
            else:
                seen[name] = {None, "many"}  # an array, a float or a declared one: not a candidate
    return [
        f"input {name!r} is {next(iter(vals))} in every sample; if it takes that one value in "
        "deployment, freeze it into the model (the graph step folds what it decides), add to "
        f"the recipe: constant_inputs: {{{name}: {next(iter(vals))}}}"
        for name, vals in seen.items()
        if len(vals) == 1 and rows
    ]


def _typed(where: str, value: Any, model: ModelInput) -> np.ndarray:
    try:
        raw = np.asarray(value)
        arr = raw.astype(model.dtype)
    except (TypeError, ValueError) as err:
        raise RecipeError(
            f"{where}: {value!r} is not a {model.dtype} value ({err}); give a number or a list"
        ) from None
    fixed = len(model.dims) == arr.ndim and all(
        not isinstance(d, int) or d == s for d, s in zip(model.dims, arr.shape, strict=True)
    )
    if not fixed:
        raise RecipeError(
            f"{where}: {value!r} has shape {list(arr.shape)}, but the input is "
            f"{shown(model, None)}; give a value of that shape"
        )
    if raw.dtype.kind not in "biuf" or not np.array_equal(arr, raw):
        raise RecipeError(
            f"{where}: {value!r} does not fit the input's dtype {model.dtype} (it would become "
            f"{arr.tolist()}); give a value {model.dtype} holds exactly"
        )
    return arr
