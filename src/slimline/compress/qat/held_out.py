"""QAT judged as the task is: the declared output kind picks the loss and the kept weights.

Where a task declares how its output is judged (:mod:`slimline.outputs`), the ``qat`` step
trains and chooses its weights by what that declaration sees, not only by a distance between raw
outputs:

- **the loss** (:func:`kind_loss`): a ``probability_map`` is distilled with binary cross-entropy
  against FP32's map. The declared IoU counts the pixels on each side of the threshold; a map is
  ~0 almost everywhere, and MSE or cosine on it is ruled by the large values far from the
  threshold, while cross-entropy weighs each pixel's odds;
- **the kept weights** (:class:`DeclaredScore`): each held-out evaluation scores the student's
  output on the held-out training batches (never the evaluation rows) with the task's own judge
  (:class:`~slimline.measure.judge.Judge`) against the FP32 teacher's, and the weights of the
  best agreement are kept (the distillation loss only breaks ties). On a detector, the weights of
  the lowest MSE on raw box outputs were not those with the most boxes kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...outputs import ProbabilityMapOutput
from ..finetune import to_tensors

if TYPE_CHECKING:
    from torch import nn

    from ...measure.judge import Judge
    from ...task import Task

__all__ = [
    "TIE_WEIGHT",
    "DeclaredScore",
    "declared_output",
    "held_out_outputs",
    "kind_loss",
    "output_arrays",
]

# weight of the distillation loss (relative to its value at step 0) in the held-out score: it
# only orders evaluations of equal agreement, so it stays below one agreement step of a few
# hundred boxes or pixels
TIE_WEIGHT = 1e-3


def declared_output(task: Task, output: str | None) -> str | None:
    """The name under which the task's judge reads the trained model's (first) output:
    ``output`` (an ONNX task's converted graph names it) when the judge declares it, else the
    judge's one declared output; None where the task declares none (or several)."""
    judge = task.judge
    if judge is None:
        return None
    if output is not None and output in judge.declared:
        return output
    return next(iter(judge.declared)) if len(judge.declared) == 1 else None


def kind_loss(task: Task, output: str | None) -> str | None:
    """``finetune.embedding_loss`` that matches the declared kind of ``output`` (a model's one
    output): ``bce`` for a probability map; None where the configured loss stays."""
    if output is None or task.judge is None:
        return None
    return "bce" if isinstance(task.judge.declared[output], ProbabilityMapOutput) else None


def output_arrays(out: Any) -> list[np.ndarray]:
    """A torch model's output, or each of its outputs (a tuple or list), as float arrays."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [np.asarray(o.detach().float().numpy()) for o in items]


def held_out_outputs(
    student: Any, teacher: Any, val: list[Any]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every output of ``student`` (in eval mode, restored after) and of ``teacher`` on the
    held-out batches ``val``, each concatenated over the batches."""
    import torch

    was_training = student.training
    student.eval()
    outs, refs = [], []
    try:
        with torch.no_grad():
            for inputs, _ in val:
                x = to_tensors(inputs)
                outs.append(output_arrays(student(**x)))
                refs.append(output_arrays(teacher(**x)))
    finally:
        student.train(was_training)
    return _joined(outs), _joined(refs)


def _joined(batches: list[list[np.ndarray]]) -> list[np.ndarray]:
    return [np.concatenate(parts) for parts in zip(*batches, strict=True)]


class DeclaredScore:
    """The held-out score of a QAT student: ``1 - agreement`` of its outputs with the teacher's
    as the task's judge scores them, plus :data:`TIE_WEIGHT` x the distillation loss relative to
    the first one. Keeps each evaluation's agreement for the step's record. ``output`` names the
    model's first output for the judge, ``others`` the rest in order (an ONNX graph's outputs:
    a box decoder reads them all)."""

    def __init__(self, judge: Judge, output: str, others: tuple[str, ...] = ()) -> None:
        self.judge, self.names = judge, (output, *others)
        self.first_loss: float | None = None
        self.history: list[dict[str, float]] = []

    def agreement(self, student: nn.Module, teacher: nn.Module, val: list[Any]) -> float:
        """The lowest agreement over the declared outputs, on the held-out batches."""
        return self.of_outputs(*held_out_outputs(student, teacher, val))

    def of_outputs(self, out: list[np.ndarray], ref: list[np.ndarray]) -> float:
        """The lowest declared agreement of outputs ``out`` with the teacher's ``ref`` (the
        float-layer search ranks layers by it: ``sensitivity.declared_score``)."""
        # a torch task's module names its first output only: its others are not read
        got = dict(zip(self.names, out, strict=False))
        scores = self.judge.score(got, dict(zip(self.names, ref, strict=False)))
        return min(float(s["agreement"]) for s in scores.values())

    def __call__(
        self, student: nn.Module, teacher: nn.Module, val: list[Any], loss: float
    ) -> float:
        agree = self.agreement(student, teacher, val)
        if self.first_loss is None:
            self.first_loss = loss
        ratio = loss / self.first_loss if self.first_loss > 0 else 0.0
        self.history.append({"agreement": agree, "val_loss": loss})
        return (1.0 - agree) + TIE_WEIGHT * ratio
