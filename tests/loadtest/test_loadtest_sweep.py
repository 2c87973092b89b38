"""Knee detection with synthetic steps, a real sweep against a one-at-a-time stub, the plots."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slimline.errors import LoadTestError
from slimline.loadtest import cli as lt_cli
from slimline.loadtest.report import _section, write_standalone
from slimline.loadtest.stubserver import stub_server
from slimline.loadtest.sweep import SweepConfig, find_knee, judge_step, run_sweep


def _step(
    rate: float, p99: float, achieved: float | None = None, errors: float = 0.0
) -> dict[str, Any]:
    lat = {"p50": p99 / 2, "p95": p99 * 0.9, "p99": p99, "p999": p99 * 1.2, "max": p99 * 1.5}
    return {
        "offered_rate": rate,
        "achieved_rate": rate if achieved is None else achieved,
        "latency_ms": lat,
        "error_rate": errors,
        "config": {"rate": rate},
        "valid": True,
        "latency_cdf_ms": [[0.5, p99 / 2], [0.99, p99], [1.0, p99 * 1.5]],
    }


def test_judge_step_names_the_failed_criterion() -> None:
    assert judge_step(_step(100, 10), 50, 0.01, 0.95) == (True, "within SLO")
    assert "p99 60.0 ms > SLO 50 ms" in judge_step(_step(100, 60), 50, 0.01, 0.95)[1]
    assert "errors 2.0%" in judge_step(_step(100, 10, errors=0.02), 50, 0.01, 0.95)[1]
    assert "achieved 90.0 < 0.95" in judge_step(_step(100, 10, achieved=90), 50, 0.01, 0.95)[1]


def test_knee_is_the_highest_pass_below_the_first_failure() -> None:
    steps = [_step(10, 5), _step(20, 8), _step(40, 70), _step(30, 20), _step(80, 40)]
    # 80 rps passes by luck but lies above a failing rate: it is not the knee
    assert find_knee(steps, 50) == 3
    assert find_knee([_step(10, 60)], 50) is None


def test_sweep_climbs_stops_and_refines() -> None:
    asked: list[float] = []

    def runner(rate: float) -> dict[str, Any]:  # a server whose p99 explodes above 100 rps
        asked.append(rate)
        return _step(rate, 10 if rate <= 100 else 500)

    doc = run_sweep(
        SweepConfig(slo_p99_ms=50, start_rate=20, factor=2, refine=2, pause_s=0), runner
    )
    assert asked[:4] == [20, 40, 80, 160]
    assert asked[4] == pytest.approx(np.sqrt(80 * 160))  # ~113: fails
    assert asked[5] == pytest.approx(np.sqrt(80 * np.sqrt(80 * 160)))  # ~95: passes
    assert doc["knee"]["offered_rate"] == pytest.approx(asked[5])
    assert [s["offered_rate"] for s in doc["steps"]] == sorted(asked)
    assert doc["stopped_because"].startswith("step at 160 rps failed")


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    lt_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_sweep_finds_the_knee_of_a_one_at_a_time_server(tmp_path: Path) -> None:
    """10 ms per request, one at a time: capacity 100 rps, so the knee lies below it."""
    npz = tmp_path / "s.npz"
    np.savez(npz, x=np.ones((8, 4), np.float32))
    out = tmp_path / "sweep.json"
    with stub_server("--delay-ms", "10", "--serial") as url:
        code = _cli(
            [
                "loadtest",
                url,
                "--model",
                "stub",
                "--inputs",
                str(npz),
                "--sweep",
                "--slo-p99-ms",
                "60",
                "--rates",
                "20,40,160",
                "--refine",
                "1",
                "--duration",
                "1.0",
                "--warmup",
                "0.3",
                "--arrival",
                "constant",
                "--max-lag-ms",
                "1000",
                "--min-requests",
                "20",  # this test is about the knee; the shared test machine may be busy
                "--out",
                str(out),
            ]
        )
    doc = json.loads(out.read_text())
    assert code == 0 and doc["kind"] == "sweep"
    top = doc["steps"][-1]
    assert top["offered_rate"] == pytest.approx(160, rel=0.02) and not top["passed"]
    assert top["achieved_rate"] < 110  # the server cannot do more than 100/s
    assert 20 <= doc["knee"]["offered_rate"] < 100  # 20 and 40 pass on a quiet machine
    # server-side figures scraped from the stub's /metrics
    assert top["server"]["queue_depth_max"] > 5 and top["server"]["batch_size_mean"] == 1.0
    assert out.with_suffix(".html").read_text().count("<img") == 3
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    html = _section({}, tmp_path)
    assert html is not None and "Knee" in html


def test_standalone_html_for_a_single_load_test(tmp_path: Path) -> None:
    doc = {
        **_step(50, 20),
        "kind": "loadtest",
        "mode": "open",
        "requests": 100,
        "schedule_lag_ms": {"p99": 0.5},
        "partial": True,
    }
    paths = write_standalone(doc, tmp_path / "lt.json")
    assert [p.name for p in paths] == ["lt.html"]
    assert "PARTIAL" in paths[0].read_text()


def test_report_section_shows_capacity_and_tune_results(tmp_path: Path) -> None:
    plan = {
        "kind": "capacity",
        "peak_qps": 5000,
        "slo_p99_ms": 50,
        "headroom": 0.4,
        "machines": 21,
        "capacity_per_machine": 399.6,
        "load_at_peak": 0.596,
        "load_at_peak_minus_one": 0.626,
    }
    best = {"variant": "quantize", "serve": {"max_batch_size": 16}, "knee_rate": 812.0}
    tune = {
        "kind": "tune-serving",
        "slo_p99_ms": 50,
        "best": best,
        "configs": [
            {**best, "note": ""},
            {"variant": "fp32-onnx", "serve": {}, "knee_rate": None, "note": "dominated"},
        ],
    }
    (tmp_path / "capacity.json").write_text(json.dumps(plan))
    (tmp_path / "tune-serving.json").write_text(json.dumps(tune))
    (tmp_path / "loadtest-broken.json").write_text("{not json")
    html = _section({}, tmp_path)
    assert html is not None
    assert "<b>21 machines</b>" in html and "63% with one machine down" in html
    assert "<b>quantize</b>" in html and "812.0" in html and "dominated" in html
    assert _section({}, tmp_path / "missing") is None


def test_an_invalid_step_is_repeated_once_then_stops_the_sweep() -> None:
    calls: list[float] = []

    def flaky(rate: float) -> dict[str, Any]:
        calls.append(rate)
        step = _step(rate, 10)
        step["valid"] = not (rate == 40 and calls.count(40) == 1)  # invalid the first time only
        step["invalid_reason"] = "lag"
        return step

    doc = run_sweep(SweepConfig(slo_p99_ms=50, rates=[20, 40], pause_s=0), flaky)
    assert calls == [20, 40, 40] and doc["steps"][1]["retried"] is True

    def broken(rate: float) -> dict[str, Any]:
        return {**_step(rate, 10), "valid": False, "invalid_reason": "schedule lag p99 99 ms"}

    with pytest.raises(LoadTestError, match="sweep step at 20 rps is invalid: schedule lag"):
        run_sweep(SweepConfig(slo_p99_ms=50, rates=[20, 40], pause_s=0), broken)
