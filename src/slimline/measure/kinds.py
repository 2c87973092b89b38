"""Scores of one output kind against FP32's (see :mod:`slimline.outputs`): pure numpy, rows first.

Each scorer returns a dict with ``agreement`` (in [0, 1], higher is closer to FP32; the budget's
``min_agreement`` is judged on it) and the kind's own figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "box_match",
    "ctc_decode",
    "ctc_score",
    "edit_distance",
    "logits_score",
    "map_score",
]


def logits_score(out: np.ndarray, ref: np.ndarray) -> dict[str, Any]:
    """Top-1 agreement: the share of rows (and positions) whose argmax over the last axis is
    FP32's."""
    same = out.argmax(axis=-1) == ref.argmax(axis=-1)
    return {"agreement": float(same.mean()), "top1_agreement": float(same.mean())}


def map_score(out: np.ndarray, ref: np.ndarray, threshold: float) -> dict[str, Any]:
    """Per-row IoU of the maps thresholded at ``threshold``; two empty maps agree (IoU 1).
    Agreement is the mean over rows; ``iou_min`` the worst row."""
    a = out.reshape(len(out), -1) > threshold
    b = ref.reshape(len(ref), -1) > threshold
    inter = (a & b).sum(axis=1)
    union = (a | b).sum(axis=1)
    iou = np.where(union > 0, inter / np.maximum(union, 1), 1.0)
    return {
        "agreement": float(iou.mean()),
        "iou_mean": float(iou.mean()),
        "iou_min": float(iou.min()),
        "threshold": threshold,
        "on_share_fp32": float(b.mean()),
    }


def ctc_decode(scores: np.ndarray, blank: int) -> list[list[int]]:
    """Greedy CTC decoding of ``[N, T, V]`` scores: argmax per step, repeats collapsed, blanks
    dropped."""
    best = scores.argmax(axis=-1)
    seqs = []
    for row in best:
        keep = np.ones(len(row), bool)
        keep[1:] = row[1:] != row[:-1]
        seqs.append([int(c) for c in row[keep] if c != blank])
    return seqs


def edit_distance(a: Sequence[int], b: Sequence[int]) -> int:
    """Levenshtein distance (insertions, deletions, substitutions) between two sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def ctc_score(out: np.ndarray, ref: np.ndarray, blank: int) -> dict[str, Any]:
    """Character error rate of the candidate's decoding against FP32's (edits over all rows /
    FP32's characters over all rows); agreement = 1 - CER, floored at 0."""
    got, want = ctc_decode(out, blank), ctc_decode(ref, blank)
    edits = sum(edit_distance(g, w) for g, w in zip(got, want, strict=True))
    chars = sum(len(w) for w in want)
    cer = edits / chars if chars else float(edits > 0)
    return {
        "agreement": max(0.0, 1.0 - cer),
        "cer": cer,
        "exact_rows": float(np.mean([g == w for g, w in zip(got, want, strict=True)])),
        "edits": edits,
        "fp32_chars": chars,
    }


def _iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    union = _area(a)[:, None] + _area(b)[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def _area(r: np.ndarray) -> np.ndarray:
    return np.clip(r[:, 2] - r[:, 0], 0, None) * np.clip(r[:, 3] - r[:, 1], 0, None)  # type: ignore[no-any-return]


def _matches(got: np.ndarray, want: np.ndarray, min_iou: float) -> int:
    """Boxes of ``got`` matched one-to-one to boxes of ``want`` of the same class at IoU >=
    ``min_iou``, greedily by IoU."""
    if len(got) == 0 or len(want) == 0:
        return 0
    iou = _iou_matrix(got[:, :4], want[:, :4])
    iou[got[:, None, 4] != want[None, :, 4]] = 0.0
    n = 0
    while True:
        i, j = np.unravel_index(int(iou.argmax()), iou.shape)
        if iou[i, j] < min_iou:
            return n
        n += 1
        iou[i, :], iou[:, j] = 0.0, 0.0


def box_match(
    got: Sequence[np.ndarray], want: Sequence[np.ndarray], min_iou: float
) -> dict[str, Any]:
    """Recall (FP32's boxes found) and precision (the candidate's boxes that FP32 has) of the
    match at IoU >= ``min_iou``, same class, over all rows; agreement is the lower of the two.
    Each row's boxes are ``[K, 5]``: x1, y1, x2, y2, class."""
    matched = sum(_matches(g, w, min_iou) for g, w in zip(got, want, strict=True))
    n_got, n_want = sum(len(g) for g in got), sum(len(w) for w in want)
    recall = matched / n_want if n_want else float(n_got == 0)
    precision = matched / n_got if n_got else float(n_want == 0)
    return {
        "agreement": min(recall, precision),
        "recall": recall,
        "precision": precision,
        "boxes_fp32": n_want,
        "boxes": n_got,
        "iou": min_iou,
    }
