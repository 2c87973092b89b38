"""Scores per output kind, on crafted outputs: what each kind counts does not depend on how a
candidate came to differ (nothing here runs INT8 kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from slimline.measure.kinds import (
    box_match,
    ctc_decode,
    ctc_score,
    edit_distance,
    logits_score,
    map_score,
)
from slimline.measure.quality import Quality


def test_logits_agreement_counts_rows_whose_argmax_is_fp32s() -> None:
    ref = np.eye(4, dtype=np.float32)
    out = ref.copy()
    out[3] = [0, 0, 2, 1]  # argmax 2 instead of 3
    assert logits_score(out, ref)["agreement"] == 0.75


def test_map_iou_of_thresholded_maps_and_empty_maps_agree() -> None:
    ref = np.zeros((2, 1, 4, 4), np.float32)
    ref[0, 0, :2, :2] = 0.9  # 4 pixels on in row 0; row 1 is empty
    out = ref.copy()
    out[0, 0, 0, 0] = 0.1  # one pixel lost: IoU 3/4
    s = map_score(out, ref, threshold=0.5)
    assert s["iou_min"] == 0.75 and s["agreement"] == pytest.approx((0.75 + 1.0) / 2)
    # a map scaled down keeps a high cosine but loses every pixel above the threshold
    assert map_score(ref * 0.5, ref, threshold=0.5)["iou_min"] == 0.0


def test_ctc_decoding_collapses_repeats_and_drops_blanks() -> None:
    path = [0, 3, 3, 0, 3, 5, 5, 0]  # -> 3 3 5
    scores = np.eye(6, dtype=np.float32)[path][None]
    assert ctc_decode(scores, blank=0) == [[3, 3, 5]]


def test_edit_distance() -> None:
    assert edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert edit_distance([1, 3], [1, 2, 3]) == 1
    assert edit_distance([], [4, 4]) == 2
    assert edit_distance([1, 2, 3], [3, 2, 1]) == 2


def test_ctc_agreement_is_one_minus_cer_against_fp32s_decoding() -> None:
    ref = np.eye(6, dtype=np.float32)[[[1, 0, 2, 0, 3, 0, 4, 4], [5, 5, 0, 1, 0, 2, 0, 0]]]
    out = ref.copy()
    out[0, 4] = np.eye(6)[5]  # 1 2 3 4 -> 1 2 5 4: one substitution in 7 characters
    s = ctc_score(out, ref, blank=0)
    assert s["cer"] == pytest.approx(1 / 7) and s["agreement"] == pytest.approx(6 / 7)
    assert s["exact_rows"] == 0.5 and s["fp32_chars"] == 7 and s["edits"] == 1
    q = Quality(
        1.0, 1.0, 1.0, 0.0, None, declared={"out": {"kind": "ctc", **s, "cosine_mean": 1.0}}
    )
    assert "CER 0.1429 (1 edit in 7 characters) against FP32's decoding" in q.declared_text()


def _boxes(*rows: list[float]) -> np.ndarray:
    return np.array(rows, dtype=np.float64).reshape(-1, 5)


def test_boxes_match_at_iou_half_and_same_class() -> None:
    want = [_boxes([0, 0, 10, 10, 1], [20, 20, 30, 30, 2])]
    got = [
        _boxes(
            [1, 0, 11, 10, 1],  # IoU 0.82, same class: matched
            [20, 20, 30, 30, 1],  # same place, other class: not matched
            [50, 50, 60, 60, 2],  # nothing there in FP32
        )
    ]
    s = box_match(got, want, 0.5)
    assert s["recall"] == 0.5 and s["precision"] == pytest.approx(1 / 3)
    assert s["agreement"] == pytest.approx(1 / 3)
    shifted = [_boxes([6, 0, 16, 10, 1], [20, 20, 30, 30, 2])]  # IoU 4/16: below 0.5
    assert box_match(shifted, want, 0.5)["recall"] == 0.5
    assert box_match(want, want, 0.5)["agreement"] == 1.0


def test_boxes_none_on_either_side() -> None:
    empty = [np.zeros((0, 5))]
    assert box_match(empty, empty, 0.5)["agreement"] == 1.0
    s = box_match(empty, [_boxes([0, 0, 1, 1, 0])], 0.5)
    assert s["recall"] == 0.0 and s["agreement"] == 0.0
