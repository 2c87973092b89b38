"""The distillation loss of one batch (``finetune.distill``'s): KL divergence on softened logits,
plus the task loss where labels exist; cosine, MSE or binary cross-entropy between other outputs.

``bce_rows`` is binary cross-entropy in which each row of a batch weighs as a mean of per-row
scores weighs it. A probability map's declared fidelity is the mean over rows of each row's IoU
(``measure/kinds.py``); plain cross-entropy averages over pixels, so a page with much text
outweighs a crop with a few words, whose IoU moves most with a few flipped pixels. Each row's
cross-entropy is divided by its text area in the teacher's map (the sum of its probabilities,
at least :data:`MIN_AREA` of the pixels), and the weights are scaled to a mean of 1 in the batch,
so the loss keeps plain cross-entropy's scale.

``finetune.output_losses`` names a loss per output of a model with several (a detector's score
heads and box-distribution heads want different ones): any of the embedding losses, ``kl``
(softmax over the last axis, KL divergence to the teacher's, as a decoder reads class
distributions) or ``kl:N`` (the last axis split into groups of N bins, each a softmax: the
distributions of a box side that distribution-focal-loss detectors decode). Outputs it does not
name keep ``embedding_loss``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from ..errors import RecipeError
from .features import first_output

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import Tensor

__all__ = [
    "EMBEDDING_LOSSES",
    "MIN_AREA",
    "OUTPUT_LOSS",
    "LossSettings",
    "check_losses",
    "distill_loss",
    "losses_by_position",
    "outputs_loss",
]

EMBEDDING_LOSSES = Literal["cosine", "mse", "bce", "bce_rows"]
MIN_AREA = 0.01  # bce_rows: the smallest text area a row's weight divides by (share of pixels)
OUTPUT_LOSS = re.compile(r"cosine|mse|bce|bce_rows|kl(:[1-9][0-9]*)?")  # finetune.output_losses


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
    loss: str | None = None,
) -> Tensor:
    """Distillation loss of one batch (plus the task loss where labels exist); ``loss``: the
    output's own loss (``finetune.output_losses``), in place of the kind's."""
    import torch
    import torch.nn.functional as F

    s, t = student_out.float(), teacher_out.float().detach()
    if loss is not None:
        kd = _named_loss(s, t, loss)
    elif output_kind == "logits":
        temp = cfg.temperature
        s2, t2 = s.reshape(-1, s.shape[-1]), t.reshape(-1, t.shape[-1])
        kd = F.kl_div(
            F.log_softmax(s2 / temp, -1),
            F.log_softmax(t2 / temp, -1),
            log_target=True,
            reduction="batchmean",
        ) * (temp * temp)
    else:
        kd = _named_loss(s, t, cfg.embedding_loss)
    if labels is None:
        return kd
    lab = torch.as_tensor(np.asarray(labels))
    if task_loss is not None:
        return cfg.alpha * kd + (1.0 - cfg.alpha) * task_loss(student_out, lab)
    if output_kind == "logits" and not lab.is_floating_point():
        ce = F.cross_entropy(s.reshape(-1, s.shape[-1]), lab.reshape(-1).long())
        return cfg.alpha * kd + (1.0 - cfg.alpha) * ce
    return kd


def _named_loss(s: Tensor, t: Tensor, loss: str) -> Tensor:
    """One output's loss by name (an embedding loss, ``kl`` or ``kl:N``)."""
    import torch.nn.functional as F

    if loss == "cosine":
        return 1.0 - F.cosine_similarity(s.reshape(len(s), -1), t.reshape(len(t), -1), dim=1).mean()
    if loss in ("bce", "bce_rows"):
        return _soft_bce(s, t, per_row=loss == "bce_rows")
    if loss.startswith("kl"):
        return _grouped_kl(s, t, int(loss[3:]) if ":" in loss else s.shape[-1])
    return F.mse_loss(s, t)


def _grouped_kl(s: Tensor, t: Tensor, bins: int) -> Tensor:
    """KL divergence of the student's softmax to the teacher's over groups of ``bins`` values
    along the last axis, the mean over groups."""
    import torch.nn.functional as F

    if s.ndim == 0 or s.shape[-1] % bins:
        raise RecipeError(
            f"finetune.output_losses 'kl:{bins}' splits the last axis into groups of {bins}, "
            f"and this output's shape is {list(s.shape)}: name a group size that divides "
            f"{s.shape[-1] if s.ndim else 'it'} (or 'kl' for one softmax over the last axis)"
        )
    s2, t2 = s.reshape(-1, bins), t.reshape(-1, bins)
    return F.kl_div(
        F.log_softmax(s2, -1), F.log_softmax(t2, -1), log_target=True, reduction="batchmean"
    )


def losses_by_position(
    output_losses: Mapping[str, str], names: Sequence[str] | None
) -> tuple[str | None, ...]:
    """``finetune.output_losses`` (output name -> loss) as one loss or None per output of a
    model whose outputs are ``names`` (in its order); a RecipeError for a name that is not an
    output, a loss that is not one, or a model whose outputs have no names here."""
    if not output_losses:
        return ()
    if not names or len(names) < 2:
        raise RecipeError(
            "finetune.output_losses names the outputs of a model with several (QAT of an ONNX "
            "model, which distils every output); this model is distilled on one output: drop "
            "output_losses and set finetune.embedding_loss"
        )
    unknown = sorted(set(output_losses) - set(names))
    if unknown:
        raise RecipeError(
            f"finetune.output_losses names {unknown}, not outputs of this model; its outputs "
            f"are {list(names)}"
        )
    check_losses(output_losses)
    return tuple(output_losses.get(n) for n in names)


def check_losses(output_losses: Mapping[str, str]) -> None:
    """A RecipeError naming every loss of ``output_losses`` that is not one."""
    bad = {k: v for k, v in output_losses.items() if not OUTPUT_LOSS.fullmatch(v)}
    if bad:
        raise RecipeError(
            f"finetune.output_losses {bad}: a loss is one of cosine, mse, bce, bce_rows, kl "
            "or kl:N (N bins a softmax)"
        )


def outputs_loss(
    student_out: Any,
    teacher_out: Any,
    labels: Any,
    output_kind: str,
    cfg: LossSettings,
    task_loss: Callable[[Tensor, Tensor], Tensor] | None = None,
    losses: Sequence[str | None] = (),
) -> Tensor:
    """The distillation loss over every output of a model that returns several (a tuple or
    list: a detector's score and box heads), as the mean of each output's loss; one output is
    :func:`distill_loss` unchanged. The first output is the task's (its kind and labels); the
    others are distilled as non-logit outputs, and under ``mse`` each one's error is taken
    relative to its teacher's mean square, so that a head of large raw values does not drown a
    head of probabilities. ``losses`` (:func:`losses_by_position`): an output's own loss, where
    one is named, replaces that (labels still add the task loss to the first)."""
    if not isinstance(student_out, (tuple, list)) or len(student_out) == 1:
        return distill_loss(
            first_output(student_out),
            first_output(teacher_out),
            labels,
            output_kind,
            cfg,
            task_loss,
        )
    parts = []
    for i, (s, t) in enumerate(zip(student_out, teacher_out, strict=True)):
        named = losses[i] if i < len(losses) else None
        kind = output_kind if i == 0 else "other"
        loss = distill_loss(
            s, t, labels if i == 0 else None, kind, cfg, task_loss if i == 0 else None, named
        )
        if named is None and cfg.embedding_loss == "mse" and kind != "logits":
            loss = loss / t.detach().float().pow(2).mean().clamp_min(1e-12)
        parts.append(loss)
    return sum(parts[1:], parts[0]) / len(parts)


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
