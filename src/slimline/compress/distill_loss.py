"""The distillation loss of one batch (``finetune.distill``'s): KL divergence on softened logits,
plus the task loss where labels exist; cosine, MSE or binary cross-entropy between other outputs.

``bce_rows`` is binary cross-entropy in which each row of a batch weighs as a mean of per-row
scores weighs it. A probability map's declared fidelity is the mean over rows of each row's IoU
(``measure/kinds.py``); plain cross-entropy averages over pixels, so a page with much text
outweighs a crop with a few words, whose IoU moves most with a few flipped pixels. Each row's
cross-entropy is divided by its text area in the teacher's map (the sum of its probabilities,
at least :data:`MIN_AREA` of the pixels), and the weights are scaled to a mean of 1 in the batch,
so the loss keeps plain cross-entropy's scale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from ..errors import RecipeError
from .features import first_output

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import Tensor

__all__ = ["EMBEDDING_LOSSES", "MIN_AREA", "LossSettings", "distill_loss", "outputs_loss"]

EMBEDDING_LOSSES = Literal["cosine", "mse", "bce", "bce_rows"]
MIN_AREA = 0.01  # bce_rows: the smallest text area a row's weight divides by (share of pixels)


class LossSettings(Protocol):
    """The fine-tuning settings the loss reads (``FinetuneConfig``'s)."""

    @property
    def temperature(self) -> float: ...
    @property
    def alpha(self) -> float: ...
    @property
    def embedding_loss(self) -> str: ...


def distill_loss(
    student_out: Tensor,
    teacher_out: Tensor,
    labels: Any,  # a batch's labels as the task gives them (array-like), or None
    output_kind: str,
    cfg: LossSettings,
    task_loss: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> Tensor:
    """Distillation loss of one batch (plus the task loss where labels exist)."""
    import torch
    import torch.nn.functional as F

    s, t = student_out.float(), teacher_out.float().detach()
    if output_kind == "logits":
        temp = cfg.temperature
        s2, t2 = s.reshape(-1, s.shape[-1]), t.reshape(-1, t.shape[-1])
        kd = F.kl_div(
            F.log_softmax(s2 / temp, -1),
            F.log_softmax(t2 / temp, -1),
            log_target=True,
            reduction="batchmean",
        ) * (temp * temp)
    elif cfg.embedding_loss == "cosine":
        kd = 1.0 - F.cosine_similarity(s.reshape(len(s), -1), t.reshape(len(t), -1), dim=1).mean()
    elif cfg.embedding_loss in ("bce", "bce_rows"):
        kd = _soft_bce(s, t, per_row=cfg.embedding_loss == "bce_rows")
    else:
        kd = F.mse_loss(s, t)
    if labels is None:
        return kd
    lab = torch.as_tensor(np.asarray(labels))
    if task_loss is not None:
        return cfg.alpha * kd + (1.0 - cfg.alpha) * task_loss(student_out, lab)
    if output_kind == "logits" and not lab.is_floating_point():
        ce = F.cross_entropy(s.reshape(-1, s.shape[-1]), lab.reshape(-1).long())
        return cfg.alpha * kd + (1.0 - cfg.alpha) * ce
    return kd


def outputs_loss(
    student_out: Any,
    teacher_out: Any,
    labels: Any,
    output_kind: str,
    cfg: LossSettings,
    task_loss: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> Tensor:
    """The distillation loss over every output of a model that returns several (a tuple or
    list: a detector's score and box heads), as the mean of each output's loss; one output is
    :func:`distill_loss` unchanged. The first output is the task's (its kind and labels); the
    others are distilled as non-logit outputs, and under ``mse`` each one's error is taken
    relative to its teacher's mean square, so that a head of large raw values does not drown a
    head of probabilities."""
    if not isinstance(student_out, (tuple, list)) or len(student_out) == 1:
        return distill_loss(
            first_output(student_out),
            first_output(teacher_out),
            labels,
            output_kind,
            cfg,
            task_loss,
        )
    losses = []
    for i, (s, t) in enumerate(zip(student_out, teacher_out, strict=True)):
        kind = output_kind if i == 0 else "other"
        loss = distill_loss(
            s, t, labels if i == 0 else None, kind, cfg, task_loss if i == 0 else None
        )
        if cfg.embedding_loss == "mse" and kind != "logits":
            loss = loss / t.detach().float().pow(2).mean().clamp_min(1e-12)
        losses.append(loss)
    return sum(losses[1:], losses[0]) / len(losses)


def _soft_bce(student: Tensor, teacher: Tensor, per_row: bool = False) -> Tensor:
    """Binary cross-entropy of probability outputs against the teacher's probabilities (minus
    the teacher's own entropy, so that a perfect student scores 0); ``per_row``: each row
    weighted by the inverse of its teacher's text area (see the module's text)."""
    import torch.nn.functional as F

    if float(student.detach().min()) < 0.0 or float(student.detach().max()) > 1.0:
        raise RecipeError(
            "finetune.embedding_loss 'bce' needs outputs in [0, 1] (probabilities); this "
            "model's are not: use 'cosine' or 'mse'"
        )
    eps = 1e-6
    s, t = student.clamp(eps, 1.0 - eps), teacher.clamp(eps, 1.0 - eps)
    if not per_row:
        return F.binary_cross_entropy(s, t) - F.binary_cross_entropy(t, t)
    excess = F.binary_cross_entropy(s, t, reduction="none") - F.binary_cross_entropy(
        t, t, reduction="none"
    )
    rows = excess.reshape(len(excess), -1).mean(dim=1)
    area = teacher.detach().reshape(len(teacher), -1).mean(dim=1).clamp_min(MIN_AREA)
    weight = 1.0 / area
    return (rows * weight / weight.mean()).mean()
