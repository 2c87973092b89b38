"""The speed check: the static candidates are timed on a few rows' ranges before the full
calibration, and calibrated on all rows only when one can be faster than FP32. The settling
rules run on crafted per-round latencies (no verdict depends on this machine's timing); the
step runs on the tiny encoder with FP32's timing scaled, so that INT8 is forced slower or faster
on every CPU kind."""

from __future__ import annotations

from pathlib import Path

import pytest
from quant_fixtures import (
    crafted_search,
    crafted_trial,
    encoder_task,
    fp32_timed,
    make_ctx,
)

from slimline.candidate import Candidate
from slimline.compress.quant import speed_check as speed_check_mod
from slimline.compress.quant.calibrate import Calibration
from slimline.compress.quant.config import QuantizeConfig, QuantSpec
from slimline.compress.quant.plan import PrecisionPlan
from slimline.compress.quant.speed_check import SpeedCheck, _settle, speed_check, wants_speed_check
from slimline.compress.quant.step import quantize_step
from slimline.compress.quant.trial import Search
from slimline.cpu import detect as detect_cpu


def _settled(
    tmp_path: Path, fp32: list[float], a_rounds: list[float], b_rounds: list[float]
) -> tuple[Search, SpeedCheck, dict[str, int]]:
    """The check's timing of two static trials (a: minmax, b: percentile) on crafted per-round
    p50s; returns the search, the check and how many rounds each name was timed."""
    a, b = crafted_trial(tmp_path, "minmax"), crafted_trial(tmp_path, "percentile")
    seen: dict[str, int] = {}
    per_round = {"fp32-onnx": fp32, a.name: a_rounds, b.name: b_rounds}
    s = crafted_search(tmp_path, per_round, seen)
    out = SpeedCheck(None, [a, b])
    _settle(s, out)
    return s, out, seen


def test_static_candidates_slower_than_fp32_are_set_aside_once_none_can_win(
    tmp_path: Path,
) -> None:
    s, out, seen = _settled(
        tmp_path,
        [10.0, 10.1, 9.9, 10.0, 10.0],
        [11.6, 11.7, 11.5, 11.6, 11.6],
        [10.0, 9.9, 10.1, 10.0, 10.0],  # as fast as FP32: cannot beat it by 3% either
    )
    a, b = out.trials
    # two rounds settle it: with a third, neither median can fall below 0.97x FP32's
    assert seen == {"fp32-onnx": 2, a.name: 2, b.name: 2}
    assert out.slow and out.record["ratios_vs_fp32"][a.name] == pytest.approx(1.16, abs=0.01)
    assert a.slow_at_any_range is not None and a.slow_at_any_range.startswith("1.16x FP32")
    assert "not calibrated on the other rows, not evaluated" in a.slow_at_any_range
    # set aside: recorded with their reason, never judged, timed again, built on or chosen
    s.trials = [a, b]
    assert s.usable() == []
    assert s.reason(a).startswith("not faster than FP32 at any ranges: 1.16x")


def test_a_static_candidate_that_wins_a_round_sends_the_search_to_full_calibration(
    tmp_path: Path,
) -> None:
    _, out, seen = _settled(
        tmp_path,
        [10.0, 10.0, 10.0, 10.0, 10.0],
        [12.0, 12.0, 12.0, 12.0, 12.0],
        [10.0, 9.6, 10.0, 10.0, 10.0],  # 4% faster in round 2: it may be faster
    )
    a, b = out.trials
    assert seen == {"fp32-onnx": 2, a.name: 2, b.name: 2}  # the benchmark ends at the win
    assert not out.slow and out.record["result"].startswith(f"{b.name} beat FP32 by 3%")
    assert a.slow_at_any_range is None and b.slow_at_any_range is None


def test_the_check_runs_only_where_it_can_save_work() -> None:
    static = (QuantSpec(mode="static"), None)
    dynamic = (QuantSpec(mode="dynamic"), None)
    both = [static, dynamic]
    on = QuantizeConfig()
    assert wants_speed_check(on, "latency", both)
    # the size objective keeps a slower INT8 file; without dynamic candidates the statics are
    # all the INT8 the step offers
    assert not wants_speed_check(on, "size", both)
    assert not wants_speed_check(on, "latency", [static])
    assert not wants_speed_check(QuantizeConfig(speed_check=False), "latency", both)


def _calibration(rows: int, wall_s: float) -> Calibration:
    return Calibration(
        caches={}, stats={}, histograms={}, ranges={}, samples=rows, chunk_rows=rows,
        wall_s=wall_s, peak_rss_mb=0.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "wall_s", "result"),
    [
        (64, 1.0, "not run: 64 calibration rows, no more than twice the check's 32"),
        # 480 more rows at 10 ms each: about 4.8 s, less than timing would cost
        (
            512,
            0.32,
            "not timed: calibrating the other 480 rows takes about 4.8 s at the check's 10 ms",
        ),
    ],
)
def test_the_check_costs_nothing_where_the_full_calibration_is_cheap(
    tmp_path: Path, rows: int, wall_s: float, result: str
) -> None:
    s = crafted_search(tmp_path, {}, {})
    calibrated: list[int] = []

    def calibrate_rows() -> Calibration:
        calibrated.append(32)
        return _calibration(32, wall_s)

    statics = [(QuantSpec(mode="static"), PrecisionPlan({}, {}))]
    check = speed_check(s, statics, calibrate_rows, rows)
    assert check.record["result"].startswith(result)
    assert check.calibration is None and not check.slow and check.trials == []
    assert calibrated == ([] if rows == 64 else [32])  # with too few rows, not even calibrated


def test_speed_check_rows_outside_mode_auto_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"speed_check_rows.*is ignored outside mode auto"):
        QuantizeConfig(mode="static", speed_check_rows=8)


@pytest.mark.cpu_kinds
@pytest.mark.parametrize("int8_faster", [False, True])
def test_the_step_calibrates_on_all_rows_only_when_static_int8_can_be_faster(
    encoder_onnx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, int8_faster: bool
) -> None:
    """The tiny encoder has static and dynamic candidates. FP32's timing scaled 10x down makes
    every INT8 file slower: the statics are built on 8 rows' ranges, timed, set aside, and the
    search goes on with the dynamic ones; scaled 10x up, a static wins its first round and the
    step calibrates on all 32 rows as it does without the check. (The tiny encoder calibrates
    in milliseconds: the check is told to time whatever the full calibration would cost.)"""
    monkeypatch.setattr(speed_check_mod, "MIN_SAVING_S", 0.0)
    ctx = make_ctx(encoder_task(encoder_onnx, calib_batches=4), encoder_onnx, tmp_path / "w")
    fp32_timed(ctx, factor=10.0 if int8_faster else 0.1)
    rr = detect_cpu().u8s8_saturates
    cfg = QuantizeConfig(samples=32, speed_check_rows=8, reduce_range=rr, mixed_precision=False)
    out = quantize_step(cfg, Candidate("fp32-onnx", "export", None, onnx=encoder_onnx), ctx)
    check = out.meta["search"]["speed_check"]
    trials = {c["name"]: c for c in out.meta["search"]["candidates"]}
    statics = [n for n in trials if n.startswith("quantize:static")]
    # one file per graph: the percentile setting writes the minmax one's graph, other ranges
    percentile = [n for n in statics if "percentile" in n]
    assert percentile and sorted(check["trials"]) == sorted(set(statics) - set(percentile))
    assert check["slow"] is not int8_faster
    set_aside = [n for n in trials if trials[n]["slow_at_any_range"]]
    if int8_faster:
        assert out.meta["calibration"]["samples"] == 32 and set_aside == []
        assert (tmp_path / "w" / "calibration").is_dir()
        assert all(trials[n]["fidelity"] is not None for n in statics)  # evaluated as usual
    else:
        assert out.meta["calibration"]["samples"] == 8
        assert "the speed check's 8 rows only" in out.meta["calibration"]["note"]
        assert out.meta["timings_s"]["calibrate"] == 0.0
        assert not (tmp_path / "w" / "calibration").exists()
        assert sorted(set_aside) == sorted(statics)
        assert all(trials[n]["fidelity"] is None for n in statics)  # never evaluated
        twin = trials[percentile[0]]
        assert twin["slow_at_any_range"].startswith("not built: the same graph as quantize:")
        assert twin["size_bytes"] is None and twin["ratio_vs_fp32"] is not None
        assert out.meta["config"]["mode"] == "dynamic"  # the search went on without them
        reasons = {a.name: a.reason for a in ctx.alternatives}
        assert all(reasons[n].startswith("not faster than FP32 at any ranges") for n in statics)
        from slimline.report import quantization

        chosen = {"name": "quantize", "step": "quantize", "accepted": False, "meta": out.meta}
        html = quantization.search({"candidates": [chosen]}, tmp_path) or ""
        assert "not evaluated (slower than FP32 at any ranges)" in html
        assert "speed check (static candidates timed first)" in html and "no static" in html


def test_qat_is_not_trained_where_static_int8_cannot_be_faster(tmp_path: Path) -> None:
    """PTQ missed the budget, but the speed check found static INT8 slower than FP32 at any
    ranges: QAT's model runs the same kernels, so its training is skipped, and the record and a
    warning say why."""
    from slimline.compress.qat.fallback import qat_fallback

    s = crafted_search(tmp_path, {}, {})
    chosen = crafted_trial(tmp_path, "minmax")
    chosen.budget_reason = "mean cosine 0.95 < budget 0.99"
    ptq = Candidate("quantize", "quantize", "fp32-onnx", onnx=chosen.path)
    record = {"speed_check": {"slow": True, "result": "no static candidate can beat FP32 by 3%"}}
    cand = Candidate("fp32-onnx", "export", None, onnx=tmp_path / "m.onnx")
    out = qat_fallback(QuantizeConfig(fallback="qat"), cand, s.ctx, chosen, record, ptq)  # type: ignore[arg-type]
    assert out is ptq
    assert (
        "QAT skipped: no static INT8 candidate can be faster than FP32" in ptq.meta["qat_fallback"]
    )
    assert "missed the budget (mean cosine 0.95" in ptq.meta["qat_fallback"]
    assert any("QAT skipped" in w for w in s.ctx.warnings)


def test_settings_that_differ_only_in_calibration_are_timed_as_one_graph() -> None:
    from slimline.compress.quant.speed_check import same_graph

    plan = PrecisionPlan({"a": "int8", "b": "int8"}, {})
    edges = PrecisionPlan({"a": "float", "b": "int8"}, {})
    u8s8 = QuantSpec(mode="static")
    statics = [
        (u8s8, plan),
        (QuantSpec(mode="static", calibration="percentile", percentile=99.9), plan),
        (QuantSpec(mode="static", weight_type="uint8"), plan),  # another format
        (QuantSpec(mode="static", calibration="entropy"), edges),  # other float nodes
        (QuantSpec(mode="static", calibration="entropy"), plan),
    ]
    assert same_graph(statics) == [[0, 1, 4], [2], [3]]
