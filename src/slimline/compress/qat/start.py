"""Where QAT's activation ranges start, measured (``calibration: auto``, the default).

The ranges train from their calibrated start (LSQ, at a small learning rate), so the start
matters: on the zoo's two DBNet text detectors a range set by the min / max of the calibration
rows is stretched by a few outlying activations, and the fake-quant model starts far from FP32;
the central 99.99 percentile of the same rows starts it much closer (``bench/RESULTS-qat-onnx.md``).
Which calibration wins depends on the model, so both are tried and the start that scores best on
the held-out training batches (never the evaluation rows) is kept: by the declared agreement
where the task declares its output's kind (:class:`.held_out.DeclaredScore`), else by cosine to
the FP32 teacher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..finetune import to_tensors
from . import fakequant as fq
from .fakequant import CalibrationMethod
from .held_out import DeclaredScore, held_out_outputs
from .sensitivity import cosine_score

if TYPE_CHECKING:
    from ...task import Task

__all__ = ["AUTO_METHODS", "calibrated", "pick_calibration", "start_score"]

AUTO_METHODS: tuple[CalibrationMethod, ...] = ("minmax", "percentile")


def calibrated(
    module: Any,
    fmt: fq.FakeQuantFormat,
    task: Task,
    samples: int,
    method: CalibrationMethod,
    percentile: float,
) -> tuple[Any, int]:
    """The fake-quant student of ``module`` in ``fmt``, its ranges calibrated by ``method`` on
    up to ``samples`` of the task's calibration rows; and the rows."""
    student = fq.prepare(module, to_tensors(task.sample_inputs(2)), fmt)
    rows = fq.calibrate(student, task.calibration_data(), samples, method, percentile)
    return student, rows


def start_score(student: Any, teacher: Any, val: list[Any], score: DeclaredScore | None) -> float:
    """The calibrated ``student``'s score on the held-out batches ``val`` (higher is closer)."""
    if score is not None:
        return score.agreement(student, teacher, val)
    return cosine_score(*held_out_outputs(student, teacher, val))


def pick_calibration(
    build: Callable[[CalibrationMethod], tuple[Any, int]],
    teacher: Any,
    val: list[Any],
    score: DeclaredScore | None,
) -> tuple[Any, int, CalibrationMethod, dict[str, float]]:
    """The student :data:`AUTO_METHODS` calibrate best (``build(method)`` gives it and its
    calibration rows), with its rows, the method and every method's score; the first method
    wins a tie."""
    best: tuple[Any, int, CalibrationMethod] | None = None
    scores: dict[str, float] = {}
    for method in AUTO_METHODS:
        student, rows = build(method)
        scores[method] = start_score(student, teacher, val, score)
        if best is None or scores[method] > scores[best[2]]:
            best = (student, rows, method)
    assert best is not None  # AUTO_METHODS is not empty
    return best[0], best[1], best[2], scores
