"""Task metric and fidelity of a candidate against the FP32 reference outputs.

The task metric reads the primary output. Fidelity compares every output the task's signature
names (an ONNX task's model may return several: a VAD's probability and its next state): per
output, the per-row cosine (mean, min) and max abs error, recorded under ``outputs``; the
headline ``cosine_mean`` is the worst output's mean, so the budget holds for every output.
A task without a signature compares its one output (named ``output``).

Outputs the recipe declares by kind (:mod:`slimline.outputs`) are judged by that kind's
``agreement`` (:mod:`.judge`): ``agreement`` is the worst declared output's, ``cosine_judged``
the worst mean cosine of the outputs left to cosine (None when every output is declared); the
cosine of every output is kept beside it. A metric hook that raises or returns a non-finite value
on a candidate gives ``metric_error`` (the candidate is then over budget), on FP32 an error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import DataError, TaskError
from ..signature import concat_outputs, n_rows, rows_first
from ..task import Task, iter_rows
from .runners import Runner

__all__ = [
    "Quality",
    "Reference",
    "collect_outputs",
    "evaluate",
    "fidelity",
    "make_reference",
    "metric_of",
]


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
    agreement: float | None = None  # the worst declared output's agreement with FP32
    declared: dict[str, dict[str, Any]] | None = None  # per declared output: kind, figures
    cosine_judged: float | None = None  # worst mean cosine of the undeclared outputs
    metric_error: str | None = None  # the metric hook failed on this candidate

    def __post_init__(self) -> None:
        if self.declared is None and self.cosine_judged is None:
            self.cosine_judged = self.cosine_mean

    def fidelity_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("metric")
        for key in ("outputs", "agreement", "declared", "metric_error"):
            if d[key] is None:
                d.pop(key)
        if self.declared is None:
            d.pop("cosine_judged")
        return d

    def declared_text(self) -> str:
        """The declared outputs' agreement, e.g. ``ctc 'out' CER 0.012 (agreement 0.988)``."""
        return "; ".join(_one_text(n, f) for n, f in (self.declared or {}).items())


def _one_text(name: str, f: dict[str, Any]) -> str:
    kind, agree = f["kind"], f["agreement"]
    if "error" in f:
        return f"{kind} {name!r}: {f['error']}"
    detail = {
        "logits": lambda: f"top-1 agreement {f['top1_agreement']:.4f}",
        "probability_map": lambda: f"IoU {f['iou_mean']:.4f} at threshold {f['threshold']}",
        "ctc": lambda: f"CER {f['cer']:.4f}{_edits(f)} against FP32's decoding",
        "boxes": lambda: f"box recall {f['recall']:.4f}, precision {f['precision']:.4f}",
    }[kind]()
    return f"{kind} {name!r} {detail} (agreement {agree:.4f}; cosine {f['cosine_mean']:.4f})"


def _edits(f: dict[str, Any]) -> str:
    """How many edits the CER counts, over how many characters: a budget of CER 0.01 over 182
    characters allows one edit, and a verdict that turns on one flip should say so."""
    if "edits" not in f:
        return ""
    edits = f"{f['edits']} edit" + ("" if f["edits"] == 1 else "s")
    return f" ({edits} in {f['fp32_chars']} characters)"


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
    """FP32's outputs and metric; the output declarations are checked against them here,
    before any candidate is judged."""
    outputs, labels, every = collect_outputs(runner, task, limit)
    metric, error = metric_of(task, outputs, labels, every)
    if error is not None:
        raise TaskError(f"{error} on the FP32 model's outputs; fix the hook")
    if task.judge is not None:
        task.judge.check_reference(every)
    return Reference(outputs=outputs, labels=labels, metric=metric, all_outputs=every)


def evaluate(runner: Runner, task: Task, reference: Reference, limit: int | None) -> Quality:
    outputs, labels, every = collect_outputs(runner, task, limit)
    logits = task.output_kind == "logits"
    metric, error = metric_of(task, outputs, labels, every)
    base: dict[str, Any]
    if task.signature is None or reference.all_outputs is None:
        base = fidelity(outputs, reference.outputs, logits)
        per = {next(iter(every)): base}
    else:
        base = _worst_output(every, reference.all_outputs, logits)
        per = base["outputs"]
    q = Quality(metric=metric, metric_error=error, **base)
    if task.judge is not None and reference.all_outputs is not None:
        _add_declared(q, task.judge.score(every, reference.all_outputs), per)
    return q


def metric_of(
    task: Task, outputs: np.ndarray, labels: Any, every: dict[str, np.ndarray]
) -> tuple[float, str | None]:
    """(metric, error): the task's metric, or its metric hook on every output; a hook that
    raises or returns a non-finite value gives NaN and the error."""
    if task.metric_hook is None:
        return float(task.metric(outputs, labels)), None
    name = task.metric_name
    try:
        value = float(task.metric_hook(dict(every), labels))
    except Exception as err:
        return float("nan"), f"metric hook {name} failed: {type(err).__name__}: {err}"
    if not np.isfinite(value):
        return float("nan"), f"metric hook {name} returned {value}, not a finite number"
    return value, None


def _add_declared(
    q: Quality, declared: dict[str, dict[str, Any]], per: dict[str, dict[str, float | None]]
) -> None:
    for name, f in declared.items():
        f["cosine_mean"] = per[name]["cosine_mean"]
    q.declared = declared
    q.agreement = min(float(f["agreement"]) for f in declared.values())
    rest = [float(f["cosine_mean"] or 0.0) for n, f in per.items() if n not in declared]
    q.cosine_judged = min(rest) if rest else None


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
