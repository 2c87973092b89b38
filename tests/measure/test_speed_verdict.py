"""Deciding "measurably faster" from interleaved rounds: bands, the paired sign test, pooling."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from slimline.measure.latency import (
    DRIFT_SPREAD,
    paired_speedup,
    pool_rounds,
    round_drift,
    speed_verdict,
    summarize_latency,
)
from slimline.report.html import ratio_to_base


def _lat(per_round_p50: list[float]) -> dict[str, Any]:
    """A latency summary whose rounds are 9 samples each, centred on the given medians."""
    return summarize_latency([np.full(9, v) + np.linspace(-0.1, 0.1, 9) for v in per_round_p50])


def test_summary_keeps_per_round_medians_in_round_order() -> None:
    lat = _lat([3.0, 1.0, 2.0])
    assert lat["per_round_p50"] == pytest.approx([3.0, 1.0, 2.0])
    assert lat["band"] == pytest.approx([1.0, 3.0])
    assert lat["p50"] == pytest.approx(2.0)


def test_a_drifting_round_does_not_hide_a_speed_up_that_holds_in_every_round() -> None:
    # Round 2 ran slow for both sides (the VM drifted): the bands overlap, yet the candidate won
    # every round by about a quarter. The unpaired band test alone would reject it.
    parent = _lat([19.0, 27.5, 18.7, 18.8, 19.5])
    cand = _lat([14.5, 21.3, 13.3, 14.2, 15.0])
    assert cand["band"][1] > parent["band"][0]
    verdict, pair = speed_verdict(parent, cand, min_gain=0.03)
    assert verdict == "faster"
    assert pair["faster_rounds"] == 5
    assert pair["p_value"] == pytest.approx(1 / 32)
    assert pair["ratio"] == pytest.approx(14.5 / 19.0, rel=1e-3)


def test_rounds_that_disagree_are_inconclusive_not_faster() -> None:
    # Per-round medians of a pruned encoder and its fused version in one run (2026-12-03): the
    # median ratio is 0.80, but the fused one lost two of five rounds.
    parent = _lat([14.5, 21.3, 13.3, 20.2, 21.0])
    cand = _lat([16.6, 17.0, 14.5, 13.9, 16.5])
    verdict, pair = speed_verdict(parent, cand, min_gain=0.03)
    assert verdict == "inconclusive"
    assert pair["faster_rounds"] == 3
    assert pair["p_value"] == pytest.approx(0.5)


def test_too_small_a_gain_is_not_faster_however_consistent() -> None:
    parent = _lat([10.0, 10.1, 10.2, 10.0, 10.1])
    cand = _lat([9.9, 10.0, 10.1, 9.9, 10.0])  # wins every round by 1%, min_gain is 3%
    verdict, pair = speed_verdict(parent, cand, min_gain=0.03)
    assert verdict == "not faster"
    assert pair["faster_rounds"] == 5


def test_apart_bands_are_enough_with_a_single_round() -> None:
    verdict, _ = speed_verdict(_lat([10.0]), _lat([5.0]), min_gain=0.03)
    assert verdict == "faster"


def test_pooling_a_second_measurement_settles_an_inconclusive_one() -> None:
    parent1, cand1 = _lat([10, 10, 10, 10, 10]), _lat([8, 8, 8, 11, 11])
    assert speed_verdict(parent1, cand1, 0.03)[0] == "inconclusive"
    parent2 = _lat([10.0] * 10)
    cand2 = _lat([8.0] * 9 + [11.0])
    parent, cand = pool_rounds(parent1, parent2), pool_rounds(cand1, cand2)
    assert cand["rounds"] == 15 and len(cand["per_round_p50"]) == 15
    verdict, pair = speed_verdict(parent, cand, 0.03)
    assert (verdict, pair["faster_rounds"]) == ("faster", 12)  # 12 of 15: p = 0.018
    assert pair["p_value"] == pytest.approx(0.0176, abs=1e-4)
    assert cand["p50"] == pytest.approx(8.0, abs=0.1)


def test_pairing_needs_the_same_rounds_on_both_sides() -> None:
    with pytest.raises(ValueError, match="same rounds"):
        paired_speedup(_lat([1.0, 2.0]), _lat([1.0]))


def test_report_ratio_pairs_rounds_of_the_final_benchmark() -> None:
    """The baseline ran in the slow mode (15 ms) in three rounds, the candidate in only one of
    them: every round says 0.5x (one says 0.33x), the ratio of the medians says 0.33x."""
    base = {"p50": 15.0, "per_round_p50": [10.0, 15.0, 15.0, 10.0, 15.0]}
    cand = {"p50": 5.0, "per_round_p50": [5.0, 5.0, 7.5, 5.0, 7.5]}
    assert ratio_to_base(cand, base) == pytest.approx(0.5)
    assert ratio_to_base(base, base) == pytest.approx(1.0)
    # an old manifest without per-round figures, or a mismatch: the ratio of medians
    assert ratio_to_base({"p50": 5.0}, base) == pytest.approx(1 / 3)
    assert ratio_to_base({"p50": 5.0, "per_round_p50": [5.0]}, base) == pytest.approx(1 / 3)
    assert ratio_to_base(cand, None) is None


def test_round_drift_is_the_slowest_over_the_fastest_round() -> None:
    # run 5's FP32 rounds: the machine switched mode between rounds
    assert round_drift(_lat([20.81, 19.97, 18.2, 29.87, 22.97])) == pytest.approx(
        29.87 / 18.2, rel=1e-3
    )
    steady = round_drift(_lat([18.0, 18.3, 17.9, 18.1, 18.2]))
    assert steady is not None and steady < DRIFT_SPREAD < 29.87 / 18.2
    assert round_drift(_lat([18.0])) is None  # one round cannot drift
