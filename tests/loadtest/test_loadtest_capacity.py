from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from slimline.errors import LoadTestError
from slimline.loadtest import cli as lt_cli
from slimline.loadtest.capacity import alert_rules, plan_capacity


def _sweep(knee_rate: float = 400.0) -> dict[str, Any]:
    def step(rate: float, p99: float) -> dict[str, Any]:
        lat = {"p50": 5.0, "p95": 8.0, "p99": p99, "p999": p99, "max": p99}
        return {
            "offered_rate": rate,
            "achieved_rate": rate * 0.999,
            "latency_ms": lat,
            "error_rate": 0.0,
        }

    return {
        "kind": "sweep",
        "model": "mnist",
        "slo_p99_ms": 50,
        "max_error_rate": 0.01,
        "track_ratio": 0.95,
        "steps": [step(100, 10), step(200, 12), step(knee_rate, 30), step(knee_rate * 1.5, 90)],
    }


def test_machines_for_a_peak_with_headroom() -> None:
    plan = plan_capacity(_sweep(400.0), peak_qps=5000, slo_p99_ms=50, headroom=0.4)
    cap = 400.0 * 0.999
    assert plan["capacity_per_machine"] == pytest.approx(cap)
    assert plan["machines"] == 21  # ceil(5000 / (399.6 * 0.6)) = ceil(20.85)
    assert plan["load_at_peak"] == pytest.approx(5000 / (21 * cap))
    assert plan["load_at_peak"] <= 0.6
    assert plan["load_at_peak_minus_one"] == pytest.approx(5000 / (20 * cap))
    assert plan["water_levels"]["warn_rps_per_machine"] == pytest.approx(0.7 * cap)
    # a tighter SLO takes its capacity from a lower step
    assert plan_capacity(_sweep(), 5000, 20, 0.4)["capacity_per_machine"] == pytest.approx(199.8)
    assert plan_capacity(_sweep(), 5000, 50, 0.3)["machines"] == 18


@pytest.mark.parametrize("headroom", [0.2, 0.6])
def test_headroom_outside_30_to_50_percent_is_refused(headroom: float) -> None:
    with pytest.raises(LoadTestError, match=r"outside 0\.3-0\.5"):
        plan_capacity(_sweep(), 5000, 50, headroom)


def test_no_step_within_the_slo_is_an_error() -> None:
    with pytest.raises(LoadTestError, match="no sweep step meets p99 <= 5 ms"):
        plan_capacity(_sweep(), 5000, 5, 0.4)


def test_alert_rules_encode_the_water_levels(tmp_path: Path) -> None:
    plan = plan_capacity(_sweep(), 5000, 50, 0.4)
    rules = alert_rules(plan)
    group = rules["groups"][0]
    record, warn, act = group["rules"]
    assert record["record"] == "slimline:machine_load:ratio"
    assert (
        'slimline_requests_total{model="mnist"}' in record["expr"] and "/ 399.6" in record["expr"]
    )
    assert (
        ">= 0.7" in warn["expr"]
        and "<= 0.85" in warn["expr"]
        and warn["labels"]["severity"] == "warning"
    )
    assert "> 0.85" in act["expr"] and act["labels"]["severity"] == "critical"
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    if shutil.which("promtool"):
        check = subprocess.run(
            ["promtool", "check", "rules", str(path)], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert "3 rules found" in check.stdout


def test_capacity_cli_writes_plan_and_rules(tmp_path: Path) -> None:
    src = tmp_path / "sweep.json"
    src.write_text(json.dumps(_sweep()))
    parser = argparse.ArgumentParser()
    lt_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "capacity",
            str(src),
            "--peak-qps",
            "5000",
            "--slo-p99-ms",
            "50",
            "--out",
            str(tmp_path / "plan.json"),
            "--rules",
            str(tmp_path / "r.yaml"),
        ]
    )
    assert args.func(args) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["kind"] == "capacity" and plan["machines"] == 21 and plan["headroom"] == 0.4
    assert (
        yaml.safe_load((tmp_path / "r.yaml").read_text())["groups"][0]["rules"][2]["alert"]
        == "SlimlineLoadCritical"
    )
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    args = parser.parse_args(["capacity", str(bad), "--peak-qps", "1", "--slo-p99-ms", "1"])
    with pytest.raises(LoadTestError, match="not a slimline load-test or sweep result"):
        args.func(args)
