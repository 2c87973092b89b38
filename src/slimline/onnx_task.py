"""An ONNX file plus an ``.npz`` of sample inputs, as a task.

The samples serve as calibration and evaluation inputs; the "labels" are the FP32 model's own
outputs on them, and the metric is the mean cosine of a candidate's outputs to those (fidelity).
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError, InputMismatchError, ModelFileError
from .task import Inputs, Task, check_inputs

__all__ = ["load_samples", "onnx_task"]

_BATCH = 16


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
    sizes = {len(a) for a in arrays.values()}
    if len(sizes) != 1:
        raise InputMismatchError(
            f"samples in {path} have different batch sizes {sorted(sizes)}; give each input the same number of rows"
        )
    return arrays


def onnx_task(path: Path, samples: Path | None) -> Task:
    from .measure.runners import OrtRunner

    if not path.is_file():
        raise ModelFileError(f"ONNX file {path} does not exist; check the path")
    if samples is None:
        raise DataError(
            f"ONNX task {path} needs sample inputs: pass --samples inputs.npz (arrays keyed by input name)"
        )
    data = load_samples(samples)
    runner = OrtRunner(path.stem, path, 1, user_model=True)  # ModelFileError if ORT refuses it
    check_inputs(data, runner.spec, f"samples {samples.name} for {path.name}")

    def batches() -> Iterator[Inputs]:
        n = len(next(iter(data.values())))
        for i in range(0, n, _BATCH):
            yield {k: v[i : i + _BATCH] for k, v in data.items()}

    @cache
    def reference() -> np.ndarray:
        return np.concatenate([runner.run(b) for b in batches()])

    def eval_data() -> Iterator[tuple[Inputs, Any]]:
        ref, start = reference(), 0
        for b in batches():
            n = len(next(iter(b.values())))
            yield b, ref[start : start + n]
            start += n

    def metric(outputs: np.ndarray, labels: Any) -> float:
        a = outputs.reshape(len(outputs), -1).astype(np.float64)
        b = np.asarray(labels).reshape(len(labels), -1).astype(np.float64)
        cos = (a * b).sum(1) / np.maximum(
            np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12
        )
        return float(cos.mean())

    return Task(
        name=path.stem,
        source=str(path),
        calibration_data=batches,
        eval_data=eval_data,
        metric=metric,
        metric_name="fidelity",
        output_kind="other",
        onnx_path=path,
    )
