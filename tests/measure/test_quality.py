"""Fidelity figures on outputs that are nearly zero everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from slimline.measure.quality import fidelity


def test_identical_near_zero_rows_have_cosine_one() -> None:
    """A text detector's probability map on a row without text is ~1e-7 everywhere: identical
    outputs must score cosine 1.0, not the ~0 a floored denominator gave."""
    ref = np.full((3, 64), 1e-7, np.float32)
    ref[0] = np.linspace(0.1, 0.9, 64)
    fid = fidelity(ref.copy(), ref, logits=False)
    assert fid["cosine_min"] == 1.0 and fid["max_abs_err"] == 0.0


def test_near_zero_rows_that_differ_are_scored_by_their_direction() -> None:
    ref = np.full((2, 8), 1e-7, np.float64)
    out = ref.copy()
    out[0, 0] = 2e-7  # a small change of direction
    out[1] = -ref[1]  # the opposite direction
    fid = fidelity(out, ref, logits=False)
    expected = (1e-7 * 2e-7 + 7 * 1e-14) / (np.linalg.norm(out[0]) * np.linalg.norm(ref[0]))
    assert fid["cosine_mean"] == pytest.approx((expected - 1.0) / 2)
    assert fid["cosine_min"] == pytest.approx(-1.0)


def test_a_zero_row_against_a_non_zero_one_has_cosine_zero() -> None:
    ref = np.zeros((1, 4), np.float32)
    fid = fidelity(np.ones((1, 4), np.float32), ref, logits=False)
    assert fid["cosine_min"] == 0.0


def test_an_onnx_tasks_metric_scores_identical_near_zero_outputs_one() -> None:
    """The ONNX task's metric (mean cosine to FP32) agrees with fidelity() on such rows: the
    FP32 baseline's own metric is 1.0, so candidates are not judged against a lower baseline."""
    from slimline.onnx_task import _mean_cosine

    ref = np.full((2, 16), 1e-7, np.float32)
    assert _mean_cosine(ref.copy(), ref) == 1.0
