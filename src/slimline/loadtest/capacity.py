"""Capacity planning from a sweep: machines for a peak, and alert rules with water levels.

A machine's capacity is the knee of its sweep at the given p99 SLO: the highest offered rate at
which p99 stays within the SLO, errors within the budget and the achieved rate tracks the offered
one. Headroom is the share of that capacity left free at peak (30-50%, default 40%), so at peak
each machine runs at ``1 - headroom`` of its capacity, below the 70% warning level::

    machines = ceil(peak / (capacity x (1 - headroom)))

Water levels on the per-machine load (requests/s divided by capacity): healthy below 70%,
warning from 70%, act above 85%. They are written as Prometheus alert rules on the server's
request counter.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from ..errors import LoadTestError
from .result import SCHEMA, atomic_write
from .sweep import find_knee, judge_step

__all__ = [
    "ACT_LEVEL",
    "WARN_LEVEL",
    "alert_rules",
    "plan_capacity",
    "plan_cloud_tier",
    "write_rules",
]

WARN_LEVEL = 0.70
ACT_LEVEL = 0.85
HEADROOM_RANGE = (0.30, 0.50)


def _capacity(doc: dict[str, Any], slo_p99_ms: float) -> tuple[float, dict[str, Any], list[str]]:
    """(requests/s per machine at the SLO, the step it comes from, notes)."""
    notes: list[str] = []
    if doc["kind"] == "loadtest":
        ok, why = judge_step(doc, slo_p99_ms, 0.01, 0.95)
        if not ok or doc.get("offered_rate") is None:
            raise LoadTestError(
                f"the load test does not meet the SLO ({why}); run a sweep: slimline loadtest --sweep"
            )
        notes.append("from a single open-loop load test: a lower bound; a sweep finds the knee")
        return min(doc["offered_rate"], doc["achieved_rate"]), doc, notes
    steps = doc["steps"]
    knee = find_knee(
        steps, slo_p99_ms, doc.get("max_error_rate", 0.01), doc.get("track_ratio", 0.95)
    )
    if knee is None:
        raise LoadTestError(
            f"no sweep step meets p99 <= {slo_p99_ms:g} ms; start the sweep at a lower rate "
            "or serve a faster configuration"
        )
    if knee == len(steps) - 1:
        notes.append(
            "every step met the SLO: the sweep did not reach the knee, capacity may be higher"
        )
    if slo_p99_ms > doc.get("slo_p99_ms", slo_p99_ms) and knee == len(steps) - 1:
        notes.append(
            f"the sweep stopped at its own SLO {doc['slo_p99_ms']:g} ms; rerun it at {slo_p99_ms:g} ms"
        )
    step = steps[knee]
    return min(step["offered_rate"], step["achieved_rate"]), step, notes


def plan_capacity(
    doc: dict[str, Any],
    peak_qps: float,
    slo_p99_ms: float,
    headroom: float = 0.40,
    source: str | None = None,
) -> dict[str, Any]:
    """The plan for ``peak_qps`` from a sweep (or one load test) result."""
    lo, hi = HEADROOM_RANGE
    if not lo <= headroom <= hi:
        raise LoadTestError(
            f"--headroom {headroom:g} is outside {lo:g}-{hi:g}; 0.4 keeps 40% free at peak"
        )
    if peak_qps <= 0 or slo_p99_ms <= 0:
        raise LoadTestError("--peak-qps and --slo-p99-ms must be positive")
    capacity, step, notes = _capacity(doc, slo_p99_ms)
    machines = max(1, math.ceil(peak_qps / (capacity * (1 - headroom)) - 1e-9))
    return {
        "schema": SCHEMA,
        "kind": "capacity",
        "source": source,
        "model": doc.get("model") or (doc.get("config") or {}).get("model"),
        "peak_qps": peak_qps,
        "slo_p99_ms": slo_p99_ms,
        "headroom": headroom,
        "capacity_per_machine": capacity,
        "knee_latency_ms": step["latency_ms"],
        "knee_step": {"offered_rate": step.get("offered_rate"), "server": step.get("server")},
        "machines": machines,
        "load_at_peak": peak_qps / (machines * capacity),
        "load_at_peak_minus_one": peak_qps / ((machines - 1) * capacity) if machines > 1 else None,
        "water_levels": {
            "healthy_below": WARN_LEVEL,
            "warn_from": WARN_LEVEL,
            "act_above": ACT_LEVEL,
            "warn_rps_per_machine": WARN_LEVEL * capacity,
            "act_rps_per_machine": ACT_LEVEL * capacity,
        },
        "notes": notes,
    }


def _knee_escalation(doc: dict[str, Any], step: dict[str, Any]) -> float | None:
    """The escalation rate the cascade's server reported at the step capacity came from."""
    return ((step.get("server") or doc.get("server")) or {}).get("escalation_rate")


def plan_cloud_tier(
    edge_plan: dict[str, Any],
    cascade_doc: dict[str, Any],
    cloud_doc: dict[str, Any],
    escalation_rate: float | None = None,
    source: str | None = None,
) -> dict[str, Any]:
    """Machines of a cascade's cloud tier: the escalated share of the peak, planned on the cloud
    model's own sweep at the same SLO and headroom (``edge_plan`` is the cascade's own plan)."""
    if escalation_rate is None:
        escalation_rate = _knee_escalation(cascade_doc, edge_plan["knee_step"])
    if escalation_rate is None:
        raise LoadTestError(
            "the cascade's result reports no escalation rate (its server's /metrics was not "
            "read); pass --escalation-rate"
        )
    if not 0.0 <= escalation_rate <= 1.0:
        raise LoadTestError(f"--escalation-rate {escalation_rate:g} is not a share in 0-1")
    peak = edge_plan["peak_qps"] * escalation_rate
    plan = plan_capacity(
        cloud_doc, max(peak, 1e-9), edge_plan["slo_p99_ms"], edge_plan["headroom"], source
    )
    machines = 0 if peak == 0 else plan["machines"]
    return {
        "escalation_rate": escalation_rate,
        "peak_qps": peak,
        "capacity_per_machine": plan["capacity_per_machine"],
        "machines": machines,
        "notes": plan["notes"],
    }


def alert_rules(
    plan: dict[str, Any], requests_metric: str = "slimline_requests_total", window: str = "1m"
) -> dict[str, Any]:
    """Prometheus rules: a per-machine load ratio, warning at 70% and act above 85%."""
    model = plan.get("model") or "model"
    cap = plan["capacity_per_machine"]
    ratio = "slimline:machine_load:ratio"
    sel = f'{ratio}{{model="{model}"}}'
    return {
        "groups": [
            {
                "name": f"slimline-capacity-{model}",
                "rules": [
                    {
                        "record": ratio,
                        "expr": f'sum by (instance) (rate({requests_metric}{{model="{model}"}}[{window}])) / {cap:.6g}',
                        "labels": {"model": model},
                    },
                    {
                        "alert": "SlimlineLoadWarning",
                        "expr": f"{sel} >= {WARN_LEVEL} and {sel} <= {ACT_LEVEL}",
                        "for": "5m",
                        "labels": {"severity": "warning"},
                        "annotations": {
                            "summary": f"{model} on {{{{ $labels.instance }}}} above {WARN_LEVEL:.0%} of capacity",
                            "description": (
                                f"Load is {{{{ $value | humanizePercentage }}}} of the {cap:.1f} requests/s "
                                f"one machine serves within p99 {plan['slo_p99_ms']:g} ms; plan to add machines."
                            ),
                        },
                    },
                    {
                        "alert": "SlimlineLoadCritical",
                        "expr": f"{sel} > {ACT_LEVEL}",
                        "for": "2m",
                        "labels": {"severity": "critical"},
                        "annotations": {
                            "summary": f"{model} on {{{{ $labels.instance }}}} above {ACT_LEVEL:.0%} of capacity",
                            "description": (
                                f"Load is {{{{ $value | humanizePercentage }}}} of capacity; p99 "
                                f"{plan['slo_p99_ms']:g} ms is at risk: add machines now."
                            ),
                        },
                    },
                ],
            }
        ]
    }


def write_rules(path: Path, rules: dict[str, Any]) -> None:
    atomic_write(path, yaml.safe_dump(rules, sort_keys=False, width=120).encode())
