"""The quantize search's shortcuts that decide nothing: a trial whose median can no longer beat
FP32's leaves the timing rounds early (recorded), and the chosen trial's layer-wise table reuses
mixed precision's or is left out for a trial over budget. Latencies are crafted, so no verdict
depends on this machine's timing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from quant_fixtures import CRAFTED_ROUNDS, crafted_search, crafted_trial

from slimline.compress.quant import auto
from slimline.compress.quant.config import QuantSpec
from slimline.compress.quant.plan import MIXED, PrecisionPlan
from slimline.compress.quant.trial import Trial
from slimline.measure.quality import Quality

ROUNDS = CRAFTED_ROUNDS


def test_a_trial_that_cannot_beat_fp32_leaves_the_rounds_early(tmp_path: Path) -> None:
    fast, slow = crafted_trial(tmp_path, "minmax"), crafted_trial(tmp_path, "percentile")
    per_round = {
        "fp32-onnx": [10.0, 10.2, 9.9, 10.1, 10.0],
        fast.name: [5.0, 5.1, 4.9, 5.0, 5.2],
        slow.name: [14.0, 14.5, 13.8, 14.2, 14.1],  # 1.4x: its median cannot win after 3
    }
    seen: dict[str, int] = {}
    s = crafted_search(tmp_path, per_round, seen)
    s.trials = [fast, slow]
    s.measure([fast, slow])
    assert seen == {"fp32-onnx": 5, fast.name: 5, slow.name: 3}
    assert slow.timing_stopped is not None and slow.timing_stopped.startswith("timed 3 of 5")
    assert fast.timing_stopped is None
    assert s.faster(fast) and not s.faster(slow)  # the verdicts all rounds would have given


def test_a_close_trial_is_timed_every_round(tmp_path: Path) -> None:
    close = crafted_trial(tmp_path, "minmax")
    per_round = {
        "fp32-onnx": [10.0, 10.2, 9.9, 10.1, 10.0],
        close.name: [9.5, 9.8, 9.4, 9.9, 9.5],  # near the 3% threshold: later rounds decide
    }
    seen: dict[str, int] = {}
    s = crafted_search(tmp_path, per_round, seen)
    s.trials = [close]
    s.measure([close])
    assert seen[close.name] == 5 and close.timing_stopped is None


def test_when_every_trial_is_settled_the_benchmark_ends(tmp_path: Path) -> None:
    a, b = crafted_trial(tmp_path, "minmax"), crafted_trial(tmp_path, "percentile")
    per_round = {
        "fp32-onnx": [10.0] * 5,
        a.name: [20.0] * 5,
        b.name: [30.0] * 5,
    }
    seen: dict[str, int] = {}
    s = crafted_search(tmp_path, per_round, seen)
    s.trials = [a, b]
    s.measure([a, b])
    assert seen == {"fp32-onnx": 3, a.name: 3, b.name: 3}


@pytest.mark.parametrize(
    ("budget_ok", "cached", "measured"),
    [
        (True, False, True),  # within budget: its table is measured
        (False, True, False),  # mixed precision ranked this file: its table is reused
        (False, False, False),  # over budget, not ranked: no table, and the record says why
    ],
)
def test_the_layerwise_table_is_measured_only_when_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget_ok: bool, cached: bool, measured: bool
) -> None:
    from slimline.compress.quant import trial as trial_mod

    calls: list[Path] = []

    def fake_layer_errors(src: Path, path: Path, *a: Any) -> list[dict[str, Any]]:
        calls.append(path)
        return [{"node": "n", "sqnr_db": 20.0}]

    monkeypatch.setattr(trial_mod, "layer_errors", fake_layer_errors)
    s = crafted_search(tmp_path, {}, {})
    s.prepared = type("P", (), {"path": tmp_path / "p.onnx"})()
    t = crafted_trial(tmp_path, "minmax")
    t.budget_ok, t.budget_reason = budget_ok, "cosine 0.9 < budget 0.99"
    if cached:
        s.layer_errors(t)  # what mixed precision does with its base
        calls.clear()
    rows = auto.layerwise_for(s, t)
    assert (calls == [t.path]) == measured
    assert bool(rows) == (budget_ok or cached)
    if not rows:
        assert s.layerwise_skipped is not None and "over budget" in s.layerwise_skipped


@pytest.mark.parametrize("probe_ok", [True, False])
def test_mixed_precision_times_its_result_only_within_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe_ok: bool
) -> None:
    from slimline.compress.quant import mixed

    base = crafted_trial(tmp_path, "minmax")
    per_round = {"fp32-onnx": [10.0] * 5, base.name: [5.0] * 5}
    plan = base.plan.with_float(["n1", "n2"], MIXED)
    probe = Trial(base.spec, plan, tmp_path / "mixed.onnx")
    assert probe.name.endswith("-mixed2")
    probe.budget_ok, probe.budget_reason = probe_ok, "agreement 0.90 < budget 0.99"
    per_round[probe.name] = [6.0] * 5
    seen: dict[str, int] = {}
    s = crafted_search(tmp_path, per_round, seen)
    s.trials = [base]
    s.measure([base])
    seen.clear()
    monkeypatch.setattr(mixed, "mixed_precision", lambda s_, t: probe)
    assert mixed.mixed_from_fastest(s) is probe
    assert (probe.name in seen) == probe_ok  # timed against FP32 only when it can be chosen
    if not probe_ok:
        assert s.mixed_trace[-1]["not_timed"].endswith("agreement 0.90 < budget 0.99")
        assert "not timed (mixed precision's probe missed it)" in s.reason(probe)


def test_trials_over_budget_are_timed_only_to_rank_them(tmp_path: Path) -> None:
    """None within budget: the timing only chooses mixed precision's start, so it stops after
    RANK_ROUNDS rounds, and the ranking it gives is the one every round would have given."""
    from slimline.compress.quant.trial import RANK_ROUNDS

    a, b = crafted_trial(tmp_path, "minmax"), crafted_trial(tmp_path, "percentile")
    per_round = {
        "fp32-onnx": [10.0, 10.2, 9.9, 10.1, 10.0],
        a.name: [6.0, 6.1, 5.9, 6.0, 6.2],
        b.name: [6.4, 6.5, 6.3, 6.4, 6.6],
    }
    seen: dict[str, int] = {}
    s = crafted_search(tmp_path, per_round, seen)
    s.trials = [a, b]
    s.measure([a, b], rank_only=True)
    assert RANK_ROUNDS < ROUNDS
    assert seen == {"fp32-onnx": RANK_ROUNDS, a.name: RANK_ROUNDS, b.name: RANK_ROUNDS}
    assert a.timing_stopped is not None and "only ranks them" in a.timing_stopped
    assert a.p50() < b.p50()  # mixed precision would start from a, as with all rounds
    seen.clear()
    s.measure([a, b])  # a verdict's timing (within budget) still runs every round
    assert seen[a.name] == ROUNDS


def _graded(tmp_path: Path, slug: str, cosine: float) -> Trial:
    t = crafted_trial(tmp_path, slug)
    t.quality = Quality(
        metric=0.0, cosine_mean=cosine, cosine_min=cosine, max_abs_err=1.0, top1_agreement=None
    )
    t.budget_reason = f"mean cosine {cosine} < budget 0.9900"
    return t


@pytest.mark.parametrize("near", [True, False])
def test_a_near_miss_is_rebuilt_with_the_calibration_no_candidate_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, near: bool
) -> None:
    """Nothing qualified: the faster candidate closest to the budget is rebuilt with entropy
    calibration (the one not run up front) when it misses by at most half the allowance
    (1 - min_cosine = 0.01); a far miss costs no extra calibration."""
    minmax = _graded(tmp_path, "minmax", 0.9880 if near else 0.95)
    percentile = _graded(tmp_path, "percentile", 0.9700)
    entropy = crafted_trial(tmp_path, "entropy")
    per_round = {
        "fp32-onnx": [10.0] * 5,
        minmax.name: [6.0] * 5,
        percentile.name: [6.0] * 5,
        entropy.name: [6.1] * 5,
    }
    calibrated: list[set[str]] = []
    s = crafted_search(tmp_path, per_round, {})
    s.trials = [minmax, percentile]
    s.measure([minmax, percentile], rank_only=True)

    def more(methods: set[str]) -> dict[str, Path]:
        calibrated.append(methods)
        return {m: tmp_path / f"{m}.json" for m in methods}

    def build(spec: QuantSpec, plan: PrecisionPlan, tag: str = "") -> Trial:
        assert spec.calibration == "entropy" and plan is minmax.plan  # the closest miss's plan
        return entropy

    def judge(t: Trial) -> Trial:
        t.budget_ok, t.budget_reason = True, "within budget"
        return t

    s.calibrate_more = more
    monkeypatch.setattr(s, "build", build)
    monkeypatch.setattr(s, "judge", judge)
    good = auto.recalibrate_near_miss(s)
    assert good == ([entropy] if near else [])
    assert calibrated == ([{"entropy"}] if near else [])
    if near:
        assert s.caches["entropy"] == tmp_path / "entropy.json" and entropy in s.trials
        assert s.recalibration["from"] == minmax.name and s.recalibration["missed_by"] == 0.2
        assert "met the budget" in s.recalibration["result"]
        assert "met the budget" in auto._stopped(s, good, mixed_tried=False)
    else:
        assert "misses the budget by at most 0.5" in s.recalibration["skipped"]


def test_a_recalibrated_trial_over_budget_is_not_timed_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    minmax, entropy = _graded(tmp_path, "minmax", 0.9880), _graded(tmp_path, "entropy", 0.9870)
    percentile = _graded(tmp_path, "percentile", 0.95)
    per_round = {"fp32-onnx": [10.0] * 5, minmax.name: [6.0] * 5, percentile.name: [6.0] * 5}
    seen: dict[str, int] = {}
    s = crafted_search(tmp_path, per_round, seen)
    s.trials = [minmax, percentile]
    s.measure(s.trials, rank_only=True)
    seen.clear()
    s.calibrate_more = lambda methods: {m: tmp_path / f"{m}.json" for m in methods}
    monkeypatch.setattr(s, "build", lambda spec, plan, tag="": entropy)
    monkeypatch.setattr(s, "judge", lambda t: t)  # over budget, as graded
    assert auto.recalibrate_near_miss(s) == [] and entropy.name not in seen
    assert s.trials == [minmax, percentile, entropy]
    assert "a recalibrated near miss over budget cannot be chosen for speed" in s.reason(entropy)
    assert "did not qualify" in s.recalibration["result"]


def test_no_layerwise_table_for_a_choice_the_paired_rounds_reject(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The search's own test passes (median 0.96x FP32's, both band ends lower), but paired by
    round the ratio is 0.975: by the run's speed test the trial is not measurably faster, so no
    INT8 model of the search can be kept and its diagnostic table is not measured."""
    from slimline.compress.quant import trial as trial_mod

    monkeypatch.setattr(trial_mod, "layer_errors", lambda *a: pytest.fail("table measured"))
    t = crafted_trial(tmp_path, "minmax")
    per_round = {"fp32-onnx": [10.4, 10.4, 10.0, 9.0, 9.0], t.name: [9.6, 9.6, 9.75, 8.9, 8.9]}
    s = crafted_search(tmp_path, per_round, {})
    s.trials = [t]
    s.measure([t])
    t.budget_ok = True
    assert s.faster(t)
    assert auto.layerwise_for(s, t) == []
    assert s.layerwise_skipped is not None
    assert "misses the 3% gain round by round (median per-round ratio 0.97" in s.layerwise_skipped
