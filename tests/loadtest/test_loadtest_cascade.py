"""Load testing a cascade: its escalation figures read from /metrics over a step, and the
capacity plan of its cloud tier for the escalated share of the peak."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from slimline.errors import LoadTestError
from slimline.loadtest.capacity import plan_capacity, plan_cloud_tier
from slimline.loadtest.cli import cascade_line
from slimline.loadtest.scrape import _figures, cascade_figures
from slimline.serve.cascade import _Metrics


def exposition(edge: int, cloud: int, fallback: int, timeouts: int, cloud_s: list[float]) -> str:
    """What a cascade's server exposes, from its own metric objects."""
    registry = CollectorRegistry()
    m = _Metrics(registry, "clf")
    _Metrics(registry, "other").rows["cloud"].inc(999)
    m.rows["edge"].inc(edge)
    m.rows["cloud"].inc(cloud)
    m.rows["fallback"].inc(fallback)
    m.failures["timeout"].inc(timeouts)
    for v in cloud_s:
        m.tier["cloud"].observe(v)
    return generate_latest(registry).decode()


def test_a_steps_escalation_is_the_difference_of_the_counters() -> None:
    first = _figures(exposition(10, 2, 0, 0, [0.01, 0.01]), "clf")
    last = _figures(exposition(90, 12, 8, 3, [0.01, 0.01] + [0.05] * 10), "clf")
    fig = cascade_figures(first, last)
    assert fig["cascade_rows"] == 98
    assert fig["escalation_rate"] == pytest.approx(18 / 98)
    assert fig["cloud_fallback_rows"] == 8 and fig["cloud_failures"] == {"timeout": 3}
    assert fig["cloud_tier_mean_ms"] == pytest.approx(50.0)
    assert "edge_tier_mean_ms" not in fig
    line = cascade_line(fig)
    assert line is not None and "18.4%" in line and "timeout 3" in line
    assert cascade_figures(first, first) == {} and cascade_line({}) is None


def sweep(knees: list[tuple[float, float]], escalation: float | None = None) -> dict[str, Any]:
    steps = [
        {"offered_rate": r, "achieved_rate": r, "error_rate": 0.0, "requests": 1000,
         "latency_ms": {"p50": p99 / 2, "p95": p99, "p99": p99, "p999": p99, "max": p99},
         "server": {"escalation_rate": escalation} if escalation is not None else None}
        for r, p99 in knees
    ]  # fmt: skip
    return {"kind": "sweep", "steps": steps, "slo_p99_ms": 50.0}


def test_the_cloud_tier_serves_the_escalated_share_of_the_peak() -> None:
    cascade = sweep([(100, 10), (200, 20), (400, 80)], escalation=0.2)
    cloud = sweep([(20, 10), (40, 30), (80, 90)])
    plan = plan_capacity(cascade, 1000, 50)
    assert plan["capacity_per_machine"] == 200 and plan["machines"] == 9
    tier = plan_cloud_tier(plan, cascade, cloud)
    assert tier["escalation_rate"] == 0.2 and tier["peak_qps"] == pytest.approx(200)
    assert tier["capacity_per_machine"] == 40
    assert tier["machines"] == 9  # ceil(200 / (40 x 0.6))
    assert plan_cloud_tier(plan, cascade, cloud, escalation_rate=0.0)["machines"] == 0
    unmeasured = sweep([(200, 20)])
    with pytest.raises(LoadTestError, match="--escalation-rate"):
        plan_cloud_tier(plan_capacity(unmeasured, 1000, 50), unmeasured, cloud)
