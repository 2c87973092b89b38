"""Task metric and fidelity of a candidate against the FP32 reference outputs.

The task metric reads the primary output. Fidelity compares every output the task's signature
names (an ONNX task's model may return several: a VAD's probability and its next state): per
output, the per-row cosine (mean, min) and max abs error, recorded under ``outputs``; the
headline ``cosine_mean`` is the worst output's mean, so the budget holds for every output.
A task without a signature compares its one output.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import DataError
from ..signature import concat_outputs, n_rows, rows_first
from ..task import Task, iter_rows
from .runners import Runner

__all__ = ["Quality", "Reference", "collect_outputs", "evaluate", "fidelity", "make_reference"]


@dataclass
class Reference:
    """FP32 outputs on the evaluation data, and the FP32 metric."""

    outputs: np.ndarray
    labels: Any
    metric: float
    all_outputs: dict[str, np.ndarray] | None = None  # every output, rows first


@dataclass
class Quality:
    metric: float
    cosine_mean: float
    cosine_min: float
    max_abs_err: float
    top1_agreement: float | None
    outputs: dict[str, dict[str, float | None]] | None = None  # per output name, several outputs

    def fidelity_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("metric")
        if d["outputs"] is None:
            d.pop("outputs")
        return d


def collect_outputs(
    runner: Runner, task: Task, limit: int | None
) -> tuple[np.ndarray, Any, dict[str, np.ndarray]]:
    """(primary output, labels, every output), concatenated over the evaluation batches with
    each output's batch axis first."""
    sig = task.signature
    outs: list[dict[str, np.ndarray]] = []
    labels: list[Any] = []
    for inputs, lab in _eval_batches(task, limit):
        got = runner.run_all(inputs) if sig is not None else {"output": runner.run(inputs)}
        outs.append({k: np.asarray(v, dtype=np.float32) for k, v in got.items()})
        labels.append(lab)
    if not outs:
        raise DataError(
            f"task {task.name}: eval_data() yielded nothing; it must yield (inputs, labels) batches"
        )
    every = rows_first(concat_outputs(outs, sig), sig)
    primary = (sig.primary_output if sig is not None else None) or next(iter(every))
    return every[primary], _concat_labels(labels), every


def _eval_batches(task: Task, limit: int | None) -> Any:
    seen = 0
    for inputs, lab in task.eval_data():
        if limit is not None and seen >= limit:
            return
        n = n_rows(inputs, task.signature)
        if limit is not None and seen + n > limit:
            keep = limit - seen
            inputs = next(iter_rows([inputs], keep, task.signature))
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
    # no floor on the denominator: a probability map that is ~1e-7 everywhere (a detector on a
    # row without text) has a norm product far below any floor, and a floor made identical rows
    # score cosine ~0. Identical rows are 1, a zero row against a non-zero one is 0.
    denom = na * nb
    with np.errstate(divide="ignore", invalid="ignore"):
        raw = (a * b).sum(axis=1) / np.where(denom > 0, denom, 1.0)
    cos = np.where(np.all(a == b, axis=1), 1.0, np.where(denom > 0, raw, 0.0))
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
    outputs, labels, every = collect_outputs(runner, task, limit)
    metric = float(task.metric(outputs, labels))
    return Reference(outputs=outputs, labels=labels, metric=metric, all_outputs=every)


def evaluate(runner: Runner, task: Task, reference: Reference, limit: int | None) -> Quality:
    outputs, labels, every = collect_outputs(runner, task, limit)
    logits = task.output_kind == "logits"
    metric = float(task.metric(outputs, labels))
    if task.signature is None or reference.all_outputs is None:
        return Quality(metric=metric, **fidelity(outputs, reference.outputs, logits))  # type: ignore[arg-type]
    return Quality(metric=metric, **_worst_output(every, reference.all_outputs, logits))


def _worst_output(
    outputs: dict[str, np.ndarray], ref: dict[str, np.ndarray], logits: bool
) -> dict[str, Any]:
    """Fidelity of each output; the headline figures are the worst over outputs."""
    if set(outputs) != set(ref):
        raise DataError(
            f"candidate outputs {sorted(outputs)} differ from the FP32 model's {sorted(ref)}"
        )
    per = {name: fidelity(outputs[name], ref[name], logits) for name in ref}
    top1 = [f["top1_agreement"] for f in per.values() if f["top1_agreement"] is not None]
    return {
        "cosine_mean": min(f["cosine_mean"] for f in per.values()),  # type: ignore[type-var]
        "cosine_min": min(f["cosine_min"] for f in per.values()),  # type: ignore[type-var]
        "max_abs_err": max(f["max_abs_err"] for f in per.values()),  # type: ignore[type-var]
        "top1_agreement": min(top1) if top1 else None,
        "outputs": per,
    }
