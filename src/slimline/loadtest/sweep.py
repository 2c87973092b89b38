"""The sweep: raise the offered rate step by step and find the knee.

The knee is the highest offered rate at which p99 stays within the SLO, errors stay within
``max_error_rate`` and the achieved rate tracks the offered one (``achieved >= track_ratio x
offered``). Steps rise geometrically from ``start_rate`` by ``factor`` (or follow ``rates``)
until one fails; then ``refine`` bisection steps narrow the bracket between the last passing and
the first failing rate. A step whose measurement is invalid (the generator fell behind its
schedule) is repeated once; invalid twice, it stops the sweep with an error.

Result (``"kind": "sweep"``)::

    {"schema": 1, "kind": "sweep", "slo_p99_ms": 50, "max_error_rate": 0.01, "track_ratio": 0.95,
     "url": .., "model": .., "steps": [<loadtest result> + {"passed": .., "why": ..,
     "server": {"queue_depth_mean": .., "queue_depth_max": .., "batch_size_mean": ..}}],
     "knee": {"offered_rate": .., "achieved_rate": .., "latency_ms": {..}, "step": i} | null,
     "stopped_because": ".."}
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from pydantic import Field, model_validator

from ..errors import LoadTestError
from ..recipe import Config
from .payload import Payload
from .result import SCHEMA
from .run import LoadTestConfig, run_loadtest, sample_payloads
from .scrape import MetricsWatcher

__all__ = ["SweepConfig", "find_knee", "judge_step", "run_sweep"]

log = logging.getLogger(__name__)


class SweepConfig(Config):
    slo_p99_ms: float = Field(..., gt=0)
    rates: list[float] | None = Field(None, description="explicit rates, ascending")
    start_rate: float = Field(10.0, gt=0)
    factor: float = Field(1.5, gt=1.0)
    max_rate: float = Field(100_000.0, gt=0)
    max_steps: int = Field(15, ge=1, le=100)
    refine: int = Field(2, ge=0, le=10, description="bisection steps after the first failure")
    max_error_rate: float = Field(0.01, ge=0, lt=1)
    track_ratio: float = Field(0.95, gt=0, le=1)
    pause_s: float = Field(0.5, ge=0, description="rest between steps")

    @model_validator(mode="after")
    def _ascending(self) -> SweepConfig:
        if self.rates is not None and (
            not self.rates or self.rates != sorted(self.rates) or self.rates[0] <= 0
        ):
            raise ValueError("rates must be a non-empty ascending list of positive numbers")
        return self


def judge_step(
    step: dict[str, Any], slo_p99_ms: float, max_error_rate: float, track_ratio: float
) -> tuple[bool, str]:
    """Whether a step is within the SLO, and why not."""
    p99 = step["latency_ms"]["p99"]
    offered = step.get("offered_rate") or 0.0
    if p99 is None:
        return False, "no successful request"
    if step["error_rate"] > max_error_rate:
        return False, f"errors {step['error_rate']:.1%} > {max_error_rate:.1%}"
    if p99 > slo_p99_ms:
        return False, f"p99 {p99:.1f} ms > SLO {slo_p99_ms:g} ms"
    if step["achieved_rate"] < track_ratio * offered:
        return (
            False,
            f"achieved {step['achieved_rate']:.1f} < {track_ratio:g} x offered {offered:.1f}",
        )
    return True, "within SLO"


def find_knee(
    steps: list[dict[str, Any]],
    slo_p99_ms: float,
    max_error_rate: float = 0.01,
    track_ratio: float = 0.95,
) -> int | None:
    """Index of the highest passing step below the lowest failing rate, or ``None``."""
    judged = [
        (s["offered_rate"], judge_step(s, slo_p99_ms, max_error_rate, track_ratio)[0], i)
        for i, s in enumerate(steps)
        if s.get("offered_rate")
    ]
    failing = [r for r, ok, _ in judged if not ok]
    ceiling = min(failing) if failing else math.inf
    passing = [(r, i) for r, ok, i in judged if ok and r < ceiling]
    return max(passing)[1] if passing else None


StepRunner = Callable[[float], dict[str, Any]]


def http_step_runner(
    base: LoadTestConfig,
    scrape: bool = True,
    stop: Any = None,
    payloads: list[Payload] | None = None,
    min_requests: int = 200,
    max_step_s: float = 30.0,
) -> StepRunner:
    """Run one step at ``rate`` against a real server, with its /metrics watched.

    A step lasts ``base.duration_s``, or longer at low rates, so that it holds ``min_requests``
    (a p99 needs a few hundred samples), up to ``max_step_s``.
    """
    headers = {"Authorization": f"Bearer {base.token}"} if base.token else None
    if payloads is None:
        payloads = sample_payloads(base)

    def step(rate: float) -> dict[str, Any]:
        duration = min(max(base.duration_s or 10.0, min_requests / rate), max_step_s)
        cfg = base.model_copy(
            update={"rate": rate, "duration_s": max(duration, base.duration_s or 0)}
        )
        watcher = MetricsWatcher(base.url, base.model, headers).start() if scrape else None
        result = run_loadtest(cfg, stop=stop, payloads=payloads)
        result["server"] = watcher.stop() if watcher is not None else None
        return result

    return step


def _next_rates(cfg: SweepConfig) -> list[float]:
    if cfg.rates is not None:
        return list(cfg.rates)
    rates: list[float] = []
    r = cfg.start_rate
    while r <= cfg.max_rate * (1 + 1e-9) and len(rates) < cfg.max_steps:
        rates.append(r)
        r *= cfg.factor
    return rates


def run_sweep(
    cfg: SweepConfig, run_step: StepRunner, meta: dict[str, Any] | None = None, stop: Any = None
) -> dict[str, Any]:
    """Run the steps, stop at the first failure, refine the bracket, and name the knee."""
    steps: list[dict[str, Any]] = []
    stopped = "reached the last rate"
    for rate in _next_rates(cfg):
        if not _run_one(cfg, run_step, rate, steps):
            stopped = f"step at {rate:g} rps failed: {steps[-1]['why']}"
            break
        if stop is not None and stop.is_set():
            stopped = "interrupted"
            break
    if not (stop is not None and stop.is_set()):
        _refine(cfg, run_step, steps)
    return sweep_result(cfg, steps, stopped, meta)


def _run_one(
    cfg: SweepConfig, run_step: StepRunner, rate: float, steps: list[dict[str, Any]]
) -> bool:
    if steps and cfg.pause_s:
        time.sleep(cfg.pause_s)
    step = run_step(rate)
    if not step.get("valid", True) and not step.get("partial"):
        # one retry: a busy machine can stall the generator once; twice in a row is a verdict
        log.warning("step %g rps invalid (%s); repeating it once", rate, step["invalid_reason"])
        time.sleep(cfg.pause_s)
        step = run_step(rate)
        step["retried"] = True
    if not step.get("valid", True) and not step.get("partial"):
        raise LoadTestError(f"sweep step at {rate:g} rps is invalid: {step['invalid_reason']}")
    passed, why = judge_step(step, cfg.slo_p99_ms, cfg.max_error_rate, cfg.track_ratio)
    step["passed"], step["why"] = passed, why
    steps.append(step)
    log.info(
        "step %g rps: achieved %.1f, p99 %s ms: %s",
        rate,
        step["achieved_rate"],
        step["latency_ms"]["p99"],
        why,
    )
    return passed or bool(step.get("partial"))


def _refine(cfg: SweepConfig, run_step: StepRunner, steps: list[dict[str, Any]]) -> None:
    for _ in range(cfg.refine):
        good = [s["config"]["rate"] for s in steps if s["passed"]]
        bad = [s["config"]["rate"] for s in steps if not s["passed"]]
        if not good or not bad or min(bad) <= max(good):
            return
        lo, hi = max(good), min(bad)
        if hi / lo < 1.05:
            return
        _run_one(cfg, run_step, math.sqrt(lo * hi), steps)


def sweep_result(
    cfg: SweepConfig, steps: list[dict[str, Any]], stopped: str, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    steps = sorted(steps, key=lambda s: s["offered_rate"] or 0.0)
    knee = find_knee(steps, cfg.slo_p99_ms, cfg.max_error_rate, cfg.track_ratio)
    return {
        "schema": SCHEMA,
        "kind": "sweep",
        **(meta or {}),
        "slo_p99_ms": cfg.slo_p99_ms,
        "max_error_rate": cfg.max_error_rate,
        "track_ratio": cfg.track_ratio,
        "partial": any(s.get("partial") for s in steps),
        "steps": steps,
        "knee": None
        if knee is None
        else {
            "step": knee,
            "offered_rate": steps[knee]["offered_rate"],
            "achieved_rate": steps[knee]["achieved_rate"],
            "latency_ms": steps[knee]["latency_ms"],
        },
        "stopped_because": stopped,
        "config": cfg.model_dump(mode="json"),
    }
