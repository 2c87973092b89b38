"""An ONNX file plus ``.npz`` files of sample inputs, as a task.

The model's inputs are taken as they are: each input's batch axis is inferred from the model's
dimensions and the samples (a recipe's ``inputs:`` states it where that is ambiguous), inputs
without one (a sample rate, a fixed-size table) are passed whole to every call, and a model with
a fixed batch of 1 is fed one row at a time. Calibration uses ``samples``; evaluation uses
``eval_samples``, or, when there is none, rows held out of ``samples`` (never shared with
calibration). The "labels" are the FP32 model's own primary output on the evaluation rows, and
the metric is their mean cosine (fidelity); every output is compared by the pipeline.

With a metric hook (a recipe's ``metric: file.py:function``), the labels are the array named
``labels`` in ``eval_samples`` (rows on axis 0), and the metric is the hook called on every
output (by name, rows first) and those labels.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from .constant_inputs import constant_values
from .errors import DataError, InputMismatchError, ModelFileError, RecipeError
from .hooks import load_hook
from .signature import (
    Dim,
    ModelInput,
    Signature,
    concat_outputs,
    n_rows,
    rows_first,
    shown,
    slice_rows,
    split_rows,
)
from .taskspec import Task
from .tensors import Inputs

__all__ = ["infer_batch_axes", "load_samples", "onnx_task", "split_held_out"]

_BATCH = 16
LABELS = "labels"  # the array of an eval_samples file that holds the labels, for a metric hook
HELD_OUT_SHARE = 0.25  # of a single samples file, held out for evaluation


def load_samples(path: Path) -> Inputs:
    if not path.is_file():
        raise DataError(
            f"samples file {path} does not exist; pass an .npz of input arrays keyed by input name"
        )
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, ValueError, OSError) as err:
        raise DataError(
            f"samples file {path} is not a readable .npz ({err}); write it with numpy.savez"
        ) from None
    if not arrays:
        raise DataError(f"samples file {path} holds no arrays; save one array per model input")
    return arrays


# ---------------------------------------------------------------------------------------------
# batch axes


def _free(d: Dim) -> bool:
    return not isinstance(d, int)


def _can_batch(d: Dim) -> bool:
    return _free(d) or d == 1


def _mismatch(
    where: str, name: str, problem: str, model: ModelInput, axis: int | None, fix: str
) -> InputMismatchError:
    return InputMismatchError(
        f"{where}: input {name!r} {problem}, but the model expects {shown(model, axis)}; {fix}"
    )


def _check_names(spec: Mapping[str, ModelInput], samples: Inputs, where: str) -> None:
    extra, missing = sorted(set(samples) - set(spec)), sorted(set(spec) - set(samples))
    if extra or missing:
        takes = ", ".join(f"{k} ({shown(m, None)})" for k, m in spec.items())
        what = f"has no input named {extra[0]!r}" if extra else f"lacks input {missing[0]!r}"
        raise InputMismatchError(
            f"{where}: the file {what}; the model takes {takes}: name one array after each input"
        )


def _check_dtype_rank(name: str, model: ModelInput, arr: np.ndarray, where: str) -> None:
    if str(arr.dtype) != model.dtype:
        raise _mismatch(
            where, name, f"is {arr.dtype}", model, None, f"save it with .astype(np.{model.dtype})"
        )
    if arr.ndim == len(model.dims):
        return
    if arr.ndim == 0:
        raise _mismatch(
            where,
            name,
            "is a 0-d array",
            model,
            None,
            f"save it with {len(model.dims)} axes, one of them the rows (batch) axis",
        )
    raise _mismatch(
        where,
        name,
        f"has {arr.ndim} axes {list(arr.shape)}",
        model,
        None,
        f"save it with {len(model.dims)} axes, one of them the rows (batch) axis",
    )


def _check_hints(spec: Mapping[str, ModelInput], hints: Mapping[str, int | None]) -> None:
    for name, axis in hints.items():
        if name not in spec:
            raise RecipeError(
                f"recipe inputs: {name!r} is not an input of the model (it takes "
                f"{', '.join(spec)}); fix the name"
            )
        rank = len(spec[name].dims)
        if axis is not None and not 0 <= axis < rank:
            raise RecipeError(
                f"recipe inputs.{name}.batch_axis: {axis} is out of range for a {rank}-axis "
                "input; give an axis from 0, or null for an input without a batch axis"
            )


def _pivot(
    spec: Mapping[str, ModelInput], hints: Mapping[str, int | None], where: str
) -> tuple[str, int]:
    """The input and axis that fix the number of rows: a stated axis, else the first input whose
    axis 0 can be a batch (the usual layout), else the first with exactly one such axis."""
    for name, axis in hints.items():
        if axis is not None:
            return name, axis
    for name, m in spec.items():
        if name not in hints and m.dims and _can_batch(m.dims[0]):
            return name, 0
    for name, m in spec.items():
        axes = [a for a, d in enumerate(m.dims) if _can_batch(d)]
        if name not in hints and len(axes) == 1:
            return name, axes[0]
    first = next(iter(spec))
    raise InputMismatchError(
        f"{where}: cannot tell which axis of the inputs is the batch (rows); state it in the "
        f"recipe, e.g. inputs: {{{first}: {{batch_axis: 0}}}}"
    )


def _axis_of(
    name: str, model: ModelInput, arr: np.ndarray, rows: int, batch_name: str | None, where: str
) -> int | None:
    if not model.dims:
        return None
    if batch_name is not None and batch_name in model.dims:
        return model.dims.index(batch_name)
    fits = [a for a, d in enumerate(model.dims) if _can_batch(d) and arr.shape[a] == rows]
    if len(fits) == 1 or (fits and 0 in fits):
        return fits[0]
    if len(fits) > 1:
        raise _mismatch(
            where,
            name,
            f"has {rows} entries on axes {fits} of {list(arr.shape)}",
            model,
            None,
            f"state which is the batch in the recipe: inputs: {{{name}: {{batch_axis: K}}}}",
        )
    if any(_free(d) for d in model.dims):
        raise _mismatch(
            where,
            name,
            f"has shape {list(arr.shape)}, no axis of {rows} rows (the other inputs' batch)",
            model,
            None,
            "give every input the same number of rows, or state the input's axis in the "
            f"recipe (inputs: {{{name}: {{batch_axis: K}}}}; null: no batch axis)",
        )
    return None  # a fixed-size input without a rows axis: passed whole to every call


def infer_batch_axes(
    spec: Mapping[str, ModelInput],
    samples: Inputs,
    hints: Mapping[str, int | None],
    where: str,
) -> tuple[dict[str, int | None], int | None]:
    """Each input's batch axis, and the model's largest batch (1 when it fixes its batch at 1).

    An input's batch axis is the axis named like the batch in the model (a shared symbolic dim),
    else the one free (or size-1) axis whose size equals the number of rows; ``hints`` (the
    recipe's ``inputs:``) override both. Rank-0 inputs and fixed-size inputs with no axis of
    that many rows have none.
    """
    _check_names(spec, samples, where)
    for name, m in spec.items():
        _check_dtype_rank(name, m, samples[name], where)
    _check_hints(spec, hints)
    pivot, p_axis = _pivot(spec, hints, where)
    rows = int(samples[pivot].shape[p_axis])
    p_dim = spec[pivot].dims[p_axis]
    batch_name = p_dim if isinstance(p_dim, str) else None
    axes: dict[str, int | None] = {}
    for name, m in spec.items():
        if name in hints:
            axes[name] = hints[name]
        elif name == pivot:
            axes[name] = p_axis
        else:
            axes[name] = _axis_of(name, m, samples[name], rows, batch_name, where)
        _check_axes(name, m, samples[name], axes[name], rows, (pivot, p_axis), where)
    return axes, _max_batch(spec, axes, where)


def _check_axes(
    name: str,
    model: ModelInput,
    arr: np.ndarray,
    axis: int | None,
    rows: int,
    pivot: tuple[str, int],
    where: str,
) -> None:
    if axis is not None and arr.shape[axis] != rows:
        raise _mismatch(
            where,
            name,
            f"has {arr.shape[axis]} rows (axis {axis} of {list(arr.shape)}) where input "
            f"{pivot[0]!r} has {rows} (its axis {pivot[1]})",
            model,
            axis,
            "give every input the same number of rows",
        )
    for a, (d, s) in enumerate(zip(model.dims, arr.shape, strict=True)):
        if a != axis and isinstance(d, int) and d != s:
            raise _mismatch(
                where,
                name,
                f"has shape {list(arr.shape)}",
                model,
                axis,
                f"axis {a} must be {d}: fix that axis of the array in the file",
            )


def _max_batch(
    spec: Mapping[str, ModelInput], axes: Mapping[str, int | None], where: str
) -> int | None:
    fixed = {n: spec[n].dims[a] for n, a in axes.items() if a is not None}
    fixed = {n: d for n, d in fixed.items() if isinstance(d, int)}
    for name, d in fixed.items():
        if d != 1:
            raise InputMismatchError(
                f"{where}: the model fixes the batch axis of input {name!r} at {d}; slimline feeds a "
                "fixed-batch model one row at a time, so it needs a batch of 1 or a free batch "
                "axis: re-export the model with a dynamic (or size-1) batch axis"
            )
    if all(a is None for a in axes.values()):
        raise InputMismatchError(
            f"{where}: no input has a batch (rows) axis; state one in the recipe, e.g. "
            f"inputs: {{{next(iter(spec))}: {{batch_axis: 0}}}}"
        )
    return 1 if fixed else None


# ---------------------------------------------------------------------------------------------
# outputs


def _probe(runner: Any, inputs: Inputs, sig: Signature, where: str) -> dict[str, np.ndarray]:
    try:
        outputs: dict[str, np.ndarray] = runner.call(inputs)
        return outputs
    except Exception as err:  # ONNX Runtime raises its own Fail/InvalidArgument/... types
        # a failure inside a subgraph nests "Status Message:"s; the innermost names the cause
        first = str(err).strip().splitlines()[0].split("Status Message: ")[-1][:300]
        raise DataError(
            f"{where}: ONNX Runtime fails on the first sample row ({first}); check the samples' "
            "values (e.g. a sample rate the model does not support)"
        ) from None


def output_axes(
    runner: Any, samples: Inputs, sig: Signature, where: str
) -> tuple[dict[str, int | None], int | None]:
    """Each output's batch axis, seen by running one row and then two: the axis that grows
    from 1 to 2. A model that fails on two rows despite a free batch axis is fed row by row."""
    one = _probe(runner, slice_rows(samples, 0, 1, sig), sig, where)
    max_batch = sig.max_batch
    if max_batch is None and n_rows(samples, sig) >= 2:
        try:
            two = runner.call(slice_rows(samples, 0, 2, sig))
        except Exception:  # the batch axis is free in name only
            max_batch = 1
        else:
            return {k: _grown_axis(one[k].shape, two[k].shape) for k in one}, None
    return {
        k: _unit_axis(v.shape, runner.output_dims.get(k, [])) for k, v in one.items()
    }, max_batch


def _grown_axis(one: tuple[int, ...], two: tuple[int, ...]) -> int | None:
    grown = [a for a, (x, y) in enumerate(zip(one, two, strict=False)) if (x, y) == (1, 2)]
    return grown[0] if grown and len(one) == len(two) else None


def _unit_axis(shape: tuple[int, ...], dims: list[Dim]) -> int | None:
    """For one row's output: an axis of size 1, the one the model declares as 1 where several
    are. The run's shape decides: a declared shape can be wrong (an OCR model declaring
    ``[1, seqlen]`` returns ``[seqlen, 1, classes]``)."""
    ones = [a for a, s in enumerate(shape) if s == 1]
    if len(dims) == len(shape):
        declared = [a for a in ones if dims[a] == 1]
        ones = declared or ones
    return ones[0] if ones else None


# ---------------------------------------------------------------------------------------------
# held-out split


def split_held_out(data: Inputs, sig: Signature, where: str) -> tuple[Inputs, Inputs, str]:
    """(calibration, evaluation, note): a seeded, disjoint split of one samples file."""
    rows = n_rows(data, sig)
    if rows < 2:
        raise DataError(
            f"{where}: one row cannot be split into calibration and held-out evaluation rows; "
            "add rows, or pass separate evaluation samples (eval_samples / --eval-samples)"
        )
    held = max(1, round(rows * HELD_OUT_SHARE))
    order = np.random.default_rng(0).permutation(rows)
    evaluation, calibration = np.sort(order[:held]), np.sort(order[held:])
    note = (
        f"evaluation uses {held} of the {rows} sample rows, held out of calibration (a fixed, "
        "seeded split); pass eval_samples (--eval-samples) to evaluate on a file of your own"
    )
    return _take(data, calibration, sig), _take(data, evaluation, sig), note


def _take(data: Inputs, index: np.ndarray, sig: Signature) -> Inputs:
    out = {}
    for name, arr in data.items():
        axis = sig.inputs.get(name)
        out[name] = arr if axis is None else np.take(arr, index, axis=axis)
    return out


# ---------------------------------------------------------------------------------------------
# the task


def _signature(
    runner: Any,
    data: Inputs,
    hints: Mapping[str, int | None],
    primary: str | None,
    where: str,
) -> Signature:
    axes, max_batch = infer_batch_axes(runner.model_inputs, data, hints, where)
    partial = Signature(inputs=axes, max_batch=max_batch)
    outputs, max_batch = output_axes(runner, data, partial, where)
    batched = [name for name, axis in outputs.items() if axis is not None]
    if primary is not None and primary not in batched:
        raise RecipeError(
            f"recipe primary_output: {primary!r} is not an output of the model with a row per "
            f"sample (those are {', '.join(batched) or 'none'}); name one of those"
        )
    if not batched:
        raise DataError(
            f"{where}: no output of the model has a batch (rows) axis, so its outputs cannot be "
            "compared sample by sample; check the inputs' batch axes (recipe inputs:)"
        )
    return Signature(
        inputs=axes, outputs=outputs, max_batch=max_batch, primary=primary or batched[0]
    )


def _eval_rows(
    runner: Any, sig: Signature, data: Inputs, eval_path: Path | None, where: str
) -> tuple[Inputs, Inputs, list[str]]:
    if eval_path is None:
        calibration, evaluation, note = split_held_out(data, sig, where)
        return calibration, evaluation, [note]
    evaluation = load_samples(eval_path)
    if LABELS not in runner.model_inputs:  # a metric hook's labels (see onnx_task)
        evaluation.pop(LABELS, None)
    # the calibration file's axes hold for the evaluation file: check it against them
    infer_batch_axes(runner.model_inputs, evaluation, sig.inputs, f"samples {eval_path.name}")
    return data, evaluation, [f"evaluation uses {eval_path.name}, calibration {where}"]


def onnx_task(
    path: Path,
    samples: Path | None,
    eval_samples: Path | None = None,
    *,
    batch_axes: Mapping[str, int | None] | None = None,
    primary_output: str | None = None,
    metric: str | None = None,
    constant_inputs: Mapping[str, Any] | None = None,
) -> Task:
    from .measure.runners import OrtRunner

    if not path.is_file():
        raise ModelFileError(f"ONNX file {path} does not exist; check the path")
    if samples is None:
        raise DataError(
            f"ONNX task {path} needs sample inputs: pass --samples inputs.npz (arrays keyed by input name)"
        )
    data = load_samples(samples)
    runner = OrtRunner(path.stem, path, 1, user_model=True)  # ModelFileError if ORT refuses it
    where = f"samples {samples.name} for {path.name}"
    sig = _signature(runner, data, batch_axes or {}, primary_output, where)
    runner.signature = sig
    labels = _labels(eval_samples, metric)
    calibration, evaluation, notes = _eval_rows(runner, sig, data, eval_samples, samples.name)
    primary = sig.primary_output
    assert primary is not None
    if labels is not None:
        _check_labels(labels, n_rows(evaluation, sig), eval_samples)
    constants = constant_values(
        runner.model_inputs, sig, constant_inputs or {}, {samples.name: calibration,
        (eval_samples or samples).name: evaluation})  # fmt: skip

    def batches(rows: Inputs) -> Iterator[Inputs]:
        return split_rows(rows, _BATCH, sig)

    @cache
    def reference() -> np.ndarray:
        if labels is not None:
            return labels
        outs = concat_outputs([runner.run_all(b) for b in batches(evaluation)], sig)
        return rows_first(outs, sig)[primary]

    def eval_data() -> Iterator[tuple[Inputs, Any]]:
        ref, start = reference(), 0
        for b in batches(evaluation):
            n = n_rows(b, sig)
            yield b, ref[start : start + n]
            start += n

    return Task(
        name=path.stem,
        source=str(path),
        calibration_data=lambda: batches(calibration),
        eval_data=eval_data,
        metric=_mean_cosine,
        metric_name=metric.rpartition(":")[2] if metric else "fidelity",
        output_kind="other",
        onnx_path=path,
        signature=sig,
        notes=notes,
        metric_hook=load_hook(metric, "metric") if metric else None,
        constant_inputs=constants,
    )


def _labels(eval_samples: Path | None, metric: str | None) -> np.ndarray | None:
    """The labels a metric hook reads: ``eval_samples``' array named ``labels``."""
    if metric is None:
        return None
    if eval_samples is None:
        raise RecipeError(
            f"recipe metric: the hook {metric} needs labels; pass eval_samples, an .npz with "
            f"the evaluation inputs and an array named {LABELS!r} (one row per sample)"
        )
    arrays = load_samples(eval_samples)
    if LABELS not in arrays:
        raise RecipeError(
            f"recipe metric: eval_samples {eval_samples.name} has no array named {LABELS!r} "
            f"(it has {', '.join(arrays)}); add the labels, one row per sample"
        )
    return arrays[LABELS]


def _check_labels(labels: np.ndarray, rows: int, eval_samples: Path | None) -> None:
    if labels.ndim == 0 or len(labels) != rows:
        name = eval_samples.name if eval_samples else "eval_samples"
        raise DataError(
            f"samples {name}: {LABELS!r} has shape {list(labels.shape)} but the inputs have "
            f"{rows} rows; give one label row per sample (axis 0)"
        )


def _mean_cosine(outputs: np.ndarray, labels: Any) -> float:
    a = outputs.reshape(len(outputs), -1).astype(np.float64)
    b = np.asarray(labels).reshape(len(labels), -1).astype(np.float64)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    denom = na * nb  # no floor: see measure.quality.fidelity (near-zero probability maps)
    with np.errstate(divide="ignore", invalid="ignore"):
        raw = (a * b).sum(1) / np.where(denom > 0, denom, 1.0)
    cos = np.where(np.all(a == b, axis=1), 1.0, np.where(denom > 0, raw, 0.0))
    return float(cos.mean())
