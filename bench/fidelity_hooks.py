"""Metric hooks for ``metric: fidelity_hooks.py:FUNC`` (an ONNX task's metric on its outputs and
the ``labels`` array of ``eval_samples``)."""

from __future__ import annotations

import numpy as np


def ppocr_cls_top1(outputs: dict[str, np.ndarray], labels: np.ndarray) -> float:
    """Top-1 accuracy of PP-OCR's text-direction classifier (classes '0' and '180')."""
    probs = outputs["save_infer_model/scale_0.tmp_1"]
    return float((probs.argmax(axis=1) == labels).mean())
