"""Decode functions for ``outputs: {NAME: {kind: boxes, decode: fidelity_decode.py:FUNC}}``.

``ddddocr_yolox``: ddddocr's own post-processing of its YOLOX detector (``common_det.onnx``,
output ``[1, 3549, 6]``: cx, cy, w, h, objectness, class score on the 8/16/32-stride grids of a
416 x 416 input), as ``ddddocr/core/detection_engine.py`` does it (``demo_postprocess``, then
class-agnostic NMS at IoU 0.45 over boxes scoring above 0.1), in the letterboxed input's
pixels. Returns ``[K, 5]``: x1, y1, x2, y2, class.
"""

from __future__ import annotations

import numpy as np

SIZE, STRIDES, SCORE, NMS_IOU = 416, (8, 16, 32), 0.1, 0.45


def _grids() -> tuple[np.ndarray, np.ndarray]:
    grids, strides = [], []
    for s in STRIDES:
        n = SIZE // s
        xv, yv = np.meshgrid(np.arange(n), np.arange(n))
        grids.append(np.stack((xv, yv), 2).reshape(-1, 2))
        strides.append(np.full((n * n, 1), s))
    return np.concatenate(grids), np.concatenate(strides)


def _nms(boxes: np.ndarray, scores: np.ndarray) -> list[int]:
    x1, y1, x2, y2 = boxes.T
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)
    order, keep = scores.argsort()[::-1], []
    while order.size:
        i = int(order[0])
        keep.append(i)
        w = np.maximum(0.0, np.minimum(x2[i], x2[order[1:]]) - np.maximum(x1[i], x1[order[1:]]) + 1)
        h = np.maximum(0.0, np.minimum(y2[i], y2[order[1:]]) - np.maximum(y1[i], y1[order[1:]]) + 1)
        inter = w * h
        order = order[1:][inter / (areas[i] + areas[order[1:]] - inter) <= NMS_IOU]
    return keep


def ddddocr_yolox(outputs: dict[str, np.ndarray]) -> np.ndarray:
    pred = np.array(outputs["output"][0], dtype=np.float64)
    grids, strides = _grids()
    xy = (pred[:, :2] + grids) * strides
    wh = np.exp(pred[:, 2:4]) * strides
    scores = pred[:, 4:5] * pred[:, 5:]
    cls = scores.argmax(1)
    best = scores[np.arange(len(cls)), cls]
    boxes = np.concatenate([xy - wh / 2, xy + wh / 2], axis=1)
    mask = best > SCORE
    if not mask.any():
        return np.zeros((0, 5))
    boxes, best, cls = boxes[mask], best[mask], cls[mask]
    keep = _nms(boxes, best)
    return np.concatenate([boxes[keep], cls[keep, None].astype(np.float64)], axis=1)
