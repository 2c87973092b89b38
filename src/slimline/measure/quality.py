"""Task metric and fidelity of a candidate against the FP32 reference outputs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import DataError
from ..task import Task, iter_rows
from .runners import Runner

__all__ = ["Quality", "Reference", "collect_outputs", "evaluate", "fidelity", "make_reference"]


@dataclass
class Reference:
    """FP32 outputs on the evaluation data, and the FP32 metric."""

    outputs: np.ndarray
    labels: Any
    metric: float


@dataclass
class Quality:
    metric: float
    cosine_mean: float
    cosine_min: float
    max_abs_err: float
    top1_agreement: float | None

    def fidelity_dict(self) -> dict[str, float | None]:
        d = asdict(self)
        d.pop("metric")
        return d


def collect_outputs(runner: Runner, task: Task, limit: int | None) -> tuple[np.ndarray, Any]:
    outs: list[np.ndarray] = []
    labels: list[Any] = []
    for inputs, lab in _eval_batches(task, limit):
        outs.append(np.asarray(runner.run(inputs), dtype=np.float32))
        labels.append(lab)
    if not outs:
        raise DataError(
            f"task {task.name}: eval_data() yielded nothing; it must yield (inputs, labels) batches"
        )
    return np.concatenate(outs), _concat_labels(labels)


def _eval_batches(task: Task, limit: int | None) -> Any:
    seen = 0
    for inputs, lab in task.eval_data():
        if limit is not None and seen >= limit:
            return
        n = len(next(iter(inputs.values())))
        if limit is not None and seen + n > limit:
            keep = limit - seen
            inputs = next(iter_rows([inputs], keep))
            lab = lab[:keep] if lab is not None else None
            n = keep
        seen += n
        yield inputs, lab


def _concat_labels(labels: list[Any]) -> Any:
    if all(lab is None for lab in labels):
        return None
    try:
        return np.concatenate([np.asarray(lab) for lab in labels])
    except ValueError:
        return labels


def fidelity(outputs: np.ndarray, ref: np.ndarray, logits: bool) -> dict[str, float | None]:
    """Per-sample cosine (mean, min), max abs error, and top-1 agreement for logits."""
    if outputs.shape != ref.shape:
        raise DataError(
            f"candidate outputs have shape {outputs.shape} but FP32 outputs {ref.shape}"
        )
    a = outputs.reshape(len(outputs), -1).astype(np.float64)
    b = ref.reshape(len(ref), -1).astype(np.float64)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    denom = np.maximum(na * nb, 1e-12)
    cos = np.where((na == 0) & (nb == 0), 1.0, (a * b).sum(axis=1) / denom)
    top1 = None
    if logits and a.shape[1] > 1:
        top1 = float((a.argmax(axis=1) == b.argmax(axis=1)).mean())
    return {
        "cosine_mean": float(cos.mean()),
        "cosine_min": float(cos.min()),
        "max_abs_err": float(np.abs(a - b).max()),
        "top1_agreement": top1,
    }


def make_reference(runner: Runner, task: Task, limit: int | None) -> Reference:
    outputs, labels = collect_outputs(runner, task, limit)
    return Reference(outputs=outputs, labels=labels, metric=float(task.metric(outputs, labels)))


def evaluate(runner: Runner, task: Task, reference: Reference, limit: int | None) -> Quality:
    outputs, labels = collect_outputs(runner, task, limit)
    fid = fidelity(outputs, reference.outputs, task.output_kind == "logits")
    return Quality(metric=float(task.metric(outputs, labels)), **fid)  # type: ignore[arg-type]
