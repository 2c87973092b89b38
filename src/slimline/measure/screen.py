"""Screening on a subset of the evaluation rows: a candidate whose first rows already put the
budget out of reach is rejected without evaluating the rest.

The rule never rejects a candidate the full evaluation would keep. Every figure it bounds is a
mean over rows of a value at most 1 (each output's cosine, an ONNX task's cosine metric, top-1
agreement, a probability map's IoU), so on all ``n`` rows it is at most
``(k * subset_mean + (n - k)) / n``: the other rows matching FP32 exactly. The candidate is out
of reach when even that best case misses the budget. Figures that are not such means (a CTC
decoding's character error rate, box recall and precision, a task's own metric) are taken at
their best (they do not screen); a metric hook that fails on the subset fails on all rows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ..task import Task
from .quality import Quality, Reference, metric_of

__all__ = ["ROW_MEAN_KINDS", "best_case", "can_screen", "subset_reference"]

ROW_MEAN_KINDS = frozenset({"logits", "probability_map"})


def can_screen(task: Task, reference: Reference) -> bool:
    """Whether a subset can ever put the budget out of reach: some output is judged by a row
    mean (cosine where undeclared, or a declared kind of :data:`ROW_MEAN_KINDS`)."""
    if task.judge is None:
        return True
    declared = task.judge.declared
    outputs = reference.all_outputs or {"output": reference.outputs}
    undeclared = any(name not in declared for name in outputs)
    return undeclared or any(d.kind in ROW_MEAN_KINDS for d in declared.values())


def subset_reference(reference: Reference, task: Task, rows: int) -> Reference | None:
    """``reference`` cut to its first ``rows`` rows, with FP32's metric on them; None when the
    labels cannot be cut by rows (a list of per-batch objects)."""
    labels = reference.labels
    if labels is not None and not isinstance(labels, np.ndarray):
        return None
    outputs = reference.outputs[:rows]
    every = {k: v[:rows] for k, v in (reference.all_outputs or {}).items()}
    cut = labels[:rows] if labels is not None else None
    metric, error = metric_of(task, outputs, cut, every)
    if error is not None:
        return None
    return Reference(outputs=outputs, labels=cut, metric=metric, all_outputs=every or None)


def _up(value: float | None, k: int, n: int) -> float | None:
    return None if value is None else (k * value + (n - k)) / n


def best_case(q: Quality, task: Task, k: int, n: int) -> Quality:
    """The best figures all ``n`` rows can give after ``q`` on the first ``k`` (module doc)."""
    declared: dict[str, dict[str, Any]] | None = None
    agreement = None
    if q.declared is not None:
        declared = {
            name: {
                **f,
                "agreement": _up(f["agreement"], k, n) if f["kind"] in ROW_MEAN_KINDS else 1.0,
            }
            for name, f in q.declared.items()
        }
        agreement = min(float(f["agreement"]) for f in declared.values())
    metric = _up(q.metric, k, n) if task.metric_is_fidelity else float("inf")
    return replace(
        q,
        metric=float(metric if metric is not None else float("inf")),
        cosine_mean=float(_up(q.cosine_mean, k, n) or 0.0),
        cosine_judged=_up(q.cosine_judged, k, n),
        agreement=agreement,
        declared=declared,
    )
