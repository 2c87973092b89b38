"""CI gate: compare a run's manifest with a baseline manifest and fail on regressions.

A latency regression counts only when it exceeds both the tolerance (relative p50 increase) and
the measured noise (the candidate's p50 band lies entirely above the baseline's band). A metric
regression counts when the metric dropped by more than the allowed absolute drop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Regression", "compare_manifests"]


@dataclass
class Regression:
    candidate: str
    figure: str
    baseline: float
    current: float
    detail: str

    def __str__(self) -> str:
        return f"REGRESSION {self.candidate}: {self.figure} {self.baseline:.4g} -> {self.current:.4g} ({self.detail})"


def _by_name(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in manifest["candidates"] if not c.get("alternative")}


def _latency(name: str, base: dict[str, Any], cur: dict[str, Any], tol: float) -> Regression | None:
    b, c = base.get("latency_ms"), cur.get("latency_ms")
    if not b or not c:
        return None
    rel = c["p50"] / b["p50"] - 1.0
    beyond_band = c["band"][0] > b["band"][1]
    if rel > tol and beyond_band:
        return Regression(
            name,
            "latency p50 ms",
            b["p50"],
            c["p50"],
            f"+{rel:.1%} > {tol:.0%} tolerance, band {c['band'][0]:.3f}-{c['band'][1]:.3f} "
            f"above baseline band {b['band'][0]:.3f}-{b['band'][1]:.3f}",
        )
    return None


def _metric(
    name: str, base: dict[str, Any], cur: dict[str, Any], max_drop: float
) -> Regression | None:
    b, c = (base.get("metric") or {}).get("value"), (cur.get("metric") or {}).get("value")
    if b is None or c is None:
        return None
    drop = b - c
    if drop > max_drop:
        return Regression(name, "metric", b, c, f"drop {drop:.4f} > allowed {max_drop:.4f}")
    return None


def compare_manifests(
    current: dict[str, Any],
    baseline: dict[str, Any],
    *,
    max_latency_regression: float = 0.10,
    max_metric_drop: float = 0.005,
) -> tuple[list[Regression], list[str]]:
    """Regressions, and notes (candidates compared or missing), of ``current`` vs ``baseline``."""
    cur, base = _by_name(current), _by_name(baseline)
    regressions: list[Regression] = []
    notes: list[str] = []
    for name, b in base.items():
        c = cur.get(name)
        if c is None:
            notes.append(f"{name}: in the baseline but not in this run")
            continue
        for r in (
            _latency(name, b, c, max_latency_regression),
            _metric(name, b, c, max_metric_drop),
        ):
            if r is not None:
                regressions.append(r)
        if b.get("latency_ms") and c.get("latency_ms"):
            notes.append(
                f"{name}: p50 {b['latency_ms']['p50']:.3f} -> {c['latency_ms']['p50']:.3f} ms"
            )
    return regressions, notes
