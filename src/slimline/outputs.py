"""Output kinds: how a task's outputs are judged against FP32's, declared per output in a recipe.

The default judge is the raw-output cosine. A recipe may declare, per output name, what the task
sees in it instead::

    outputs:
      maps:   {kind: probability_map, threshold: 0.3}   # IoU of the thresholded maps
      logits: {kind: ctc, blank: 0}                     # 1 - character error rate of the decoding
      cls:    {kind: logits}                            # top-1 agreement
      pred:   {kind: boxes, decode: decode.py:decode}   # recall/precision of matched boxes
    budget: {min_agreement: 0.99}

The budget's ``min_agreement`` applies to the declared outputs, ``min_cosine`` to the others;
the cosine of every output is recorded beside the agreement. This module holds the typed
declarations, which kinds fit an output's shape, and the one-line suggestion ``profile`` prints
(a kind is never applied without being declared). The scoring is :mod:`slimline.measure.kinds`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from .config import Config

__all__ = [
    "HOOK_PATTERN",
    "KINDS",
    "BoxesOutput",
    "CtcOutput",
    "LogitsOutput",
    "OutputDecl",
    "ProbabilityMapOutput",
    "fitting_kinds",
    "misfit",
    "suggest",
]

HOOK_PATTERN = r"^.+\.py:[A-Za-z_][A-Za-z0-9_]*$"  # file.py:function
KINDS = ("logits", "probability_map", "ctc", "boxes")
CTC_MIN_VOCAB = 32  # a [N, T, V] float output with at least this many classes looks like CTC


class LogitsOutput(Config):
    """Class scores: judged by top-1 agreement with FP32 (argmax over the last axis)."""

    kind: Literal["logits"] = "logits"


class ProbabilityMapOutput(Config):
    """A map of probabilities (segmentation, text detection): judged by the IoU of the maps
    thresholded at ``threshold``, per row, against FP32's (two empty maps agree)."""

    kind: Literal["probability_map"] = "probability_map"
    threshold: float = Field(0.5, gt=0.0, lt=1.0, description="a pixel is 'on' above this")


class CtcOutput(Config):
    """Sequence scores ``[N, T, V]`` over a vocabulary with a CTC blank: judged by the character
    error rate of the greedy decoding (argmax, repeats collapsed, blanks dropped) against
    FP32's decoding; agreement = 1 - CER."""

    kind: Literal["ctc"] = "ctc"
    blank: int = Field(0, ge=0, description="index of the CTC blank class")


class BoxesOutput(Config):
    """Detections: ``decode`` (``file.py:function``, beside the recipe) turns one row's outputs
    (every output, each a batch of one) into boxes ``[K, 5]``: x1, y1, x2, y2, class. A box
    agrees when it matches an FP32 box of the same class at IoU >= ``iou``; agreement is the
    lower of recall and precision of the match."""

    kind: Literal["boxes"] = "boxes"
    decode: str = Field(..., pattern=HOOK_PATTERN, description="file.py:function")
    iou: float = Field(0.5, gt=0.0, le=1.0)


OutputDecl = Annotated[
    LogitsOutput | ProbabilityMapOutput | CtcOutput | BoxesOutput, Field(discriminator="kind")
]


def fitting_kinds(shape: tuple[int, ...]) -> list[str]:
    """The kinds an output of ``shape`` (rows first) can be declared as; cosine always fits."""
    fits = []
    if len(shape) >= 2 and shape[-1] > 1:
        fits.append("logits")
    if len(shape) >= 3:
        fits.append("probability_map")
    if len(shape) == 3 and shape[-1] > 1:
        fits.append("ctc")
    fits.append("boxes")  # the decode function reads the outputs; any shape
    return fits


def misfit(name: str, kind: str, shape: tuple[int, ...]) -> str | None:
    """One line saying that ``kind`` does not fit output ``name`` of ``shape``, or None."""
    fits = fitting_kinds(shape)
    if kind in fits:
        return None
    dims = ", ".join(["N", *(str(d) for d in shape[1:])])
    return (
        f"output {name!r} has shape [{dims}] ({len(shape)}-D), which {kind} does not fit; "
        f"kinds that fit: {', '.join(fits)} (or leave it undeclared: cosine)"
    )


def suggest(name: str, values: np.ndarray) -> str | None:
    """A one-line declaration for output ``name`` (rows first) when it looks like a kind:
    ``[N, T, V]`` float with large ``V`` -> ctc; ``[N, 1, H, W]`` within [0, 1] ->
    probability_map. None otherwise. Only a suggestion: nothing is applied."""
    if not np.issubdtype(values.dtype, np.floating) or values.size == 0:
        return None
    if values.ndim == 3 and values.shape[2] >= CTC_MIN_VOCAB and values.shape[1] > 1:
        return (
            f"output {name!r} [N, {values.shape[1]}, {values.shape[2]}] looks like CTC sequences; "
            f"to judge it by its decoded text, add to the recipe: "
            f"outputs: {{{name}: {{kind: ctc, blank: 0}}}}"
        )
    in_unit = float(values.min()) >= 0.0 and float(values.max()) <= 1.0
    if values.ndim == 4 and values.shape[1] == 1 and in_unit:
        return (
            f"output {name!r} [N, 1, {values.shape[2]}, {values.shape[3]}] looks like a "
            f"probability map; to judge it by its thresholded regions, add to the recipe: "
            f"outputs: {{{name}: {{kind: probability_map, threshold: 0.5}}}}"
        )
    return None
