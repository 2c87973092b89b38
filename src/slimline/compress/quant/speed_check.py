"""Time the static candidates before calibrating on every row (``speed_check``).

A static INT8 model's speed does not depend on its ranges: the scales and zero points are
constants of the same graph, run by the same kernels. So the automatic search builds its static
candidates from the ranges of a few calibration rows, times them interleaved with FP32, and
calibrates on all rows only when one of them can be faster. Where none can (static INT8 slower
than FP32: an AVX2-only CPU, where U8S8 runs 7-bit weights without VNNI, on a model whose
float kernels are already fast), those candidates are recorded with their timing and the search
goes on with the dynamic ones: no full calibration, no evaluation, no second timing of files
that cannot be kept. On the README's main job on an AVX2-only CPU, the full calibration alone
was 30 s of a 104 s step.

What settles it, from the per-round medians of the interleaved rounds (at most
:data:`~.trial.RANK_ROUNDS`):

* every candidate's median can no longer beat FP32's by ``min_gain`` (the bound of
  :func:`~slimline.measure.latency.median_cannot_win`, the same the search applies before
  retiring a trial): none can be faster, the full calibration is skipped;
* any candidate beat FP32 by ``min_gain`` in one round: it may be faster, so all rows are
  calibrated and the search runs as it would without the check;
* anything else (a candidate that failed to build or time on the few rows' ranges, rounds that
  settled neither way): calibrated on all rows, as without the check. The check only ever skips
  work whose result could not have been kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import error_text, is_user_error
from ...measure.latency import median_cannot_win
from ...signature import Signature, n_rows
from ...task import Inputs, iter_rows
from .calibrate import Calibration
from .config import QuantizeConfig, QuantSpec
from .plan import PrecisionPlan
from .trial import RANK_ROUNDS, Search, Trial

__all__ = ["MIN_SAVING_S", "SpeedCheck", "count_rows", "speed_check", "wants_speed_check"]

log = logging.getLogger("slimline.quantize")

# The check times its candidates only where the full calibration it may skip costs at least
# this much (estimated from its own rows): timing three static candidates and FP32 for two
# rounds, at the about 1 s per candidate per round of a deciding benchmark, costs about 8 s.
MIN_SAVING_S = 10.0


@dataclass
class SpeedCheck:
    """What the check found: the few rows' calibration, the static trials built on it (timed),
    whether none of them can be faster than FP32, and the record for the manifest."""

    calibration: Calibration | None
    trials: list[Trial] = field(default_factory=list)
    slow: bool = False
    record: dict[str, Any] = field(default_factory=dict)


def wants_speed_check(
    cfg: QuantizeConfig, objective: str, tries: list[tuple[QuantSpec, Any]]
) -> bool:
    """Whether the search checks its static candidates' speed first: automatic mode with the
    check on; the latency objective (for ``size`` a slower INT8 file still counts); and dynamic
    candidates beside the static ones (with none, the static candidates are all the INT8 the
    step offers: it calibrates them as it always did, so that other runtimes and NNCF's
    candidates still judge them). Whether the data make it worth it, :func:`speed_check`
    decides."""
    modes = {spec.mode for spec, _ in tries}
    return (
        cfg.mode == "auto"
        and cfg.speed_check
        and objective == "latency"
        and {"static", "dynamic"} <= modes
    )


def count_rows(batches: Iterable[Inputs], limit: int, sig: Signature | None) -> int:
    """Rows in ``batches``, counted up to ``limit`` (the data only: no model runs)."""
    return sum(n_rows(b, sig) for b in iter_rows(batches, limit, sig))


def speed_check(
    s: Search,
    statics: list[tuple[QuantSpec, PrecisionPlan]],
    calibrate_rows: Callable[[], Calibration],
    rows: int,
) -> SpeedCheck:
    """Calibrate on a few rows (``calibrate_rows``, with every method ``statics`` use: ONNX
    Runtime's quantizer checks that a cache's method is the one asked for), build ``statics``
    on those ranges, time them interleaved with FP32; see the module's docstring for what
    settles it. ``rows``: the rows the full calibration would run. Not run with at most twice
    the check's rows; not timed where calibrating the other rows would cost less than
    :data:`MIN_SAVING_S` (at the check's own time per row). ``s.caches`` is left on the few
    rows' ranges; the caller replaces it when it calibrates on all rows."""
    t0 = time.perf_counter()
    want = s.cfg.speed_check_rows
    if rows <= 2 * want:
        why = f"{rows} calibration rows, no more than twice the check's {want}"
        return SpeedCheck(None, record={"result": f"not run: {why}", "slow": False})
    try:
        calib = calibrate_rows()
    except Exception as err:  # the full calibration will meet it again, and say so
        if is_user_error(err):
            raise
        why = f"calibration failed: {error_text(err)}"
        return SpeedCheck(None, record={"result": f"not run: {why}", "slow": False})
    per_row = calib.wall_s / max(calib.samples, 1)
    rest = (rows - calib.samples) * per_row
    if rest < MIN_SAVING_S:
        why = (
            f"calibrating the other {rows - calib.samples} rows takes about {rest:.1f} s at the "
            f"check's {per_row * 1e3:.0f} ms per row, less than timing the static candidates "
            f"would ({MIN_SAVING_S:g} s or more)"
        )
        return SpeedCheck(None, record={"result": f"not timed: {why}", "slow": False})
    s.caches = calib.caches
    where = s.out_dir / "speed-check"
    groups = same_graph(statics)
    built = [
        s.build(statics[g[0]][0], statics[g[0]][1], statics[g[0]][1].tag, where) for g in groups
    ]
    out = SpeedCheck(calib, built)
    out.record = {"rows": calib.samples, "trials": [t.name for t in built]}
    failed = [t for t in built if t.failure]
    if failed:
        out.record["result"] = (
            f"{failed[0].name} could not be built or loaded on the ranges of "
            f"{calib.samples} rows ({failed[0].failure}): calibrating on all rows"
        )
    else:
        _settle(s, out)
    if out.slow:
        out.trials = _with_twins(statics, groups, built, where)
    out.record["slow"] = out.slow
    out.record["wall_s"] = round(time.perf_counter() - t0, 3)
    log.info("quantize: speed check: %s", out.record["result"])
    return out


def _settle(s: Search, out: SpeedCheck) -> None:
    """Time ``out.trials`` interleaved with FP32 until it is settled; fills ``out``."""
    base, gain = s.ctx.baseline.name, s.ctx.recipe.budget.min_gain
    horizon = min(RANK_ROUNDS, s.ctx.recipe.bench.rounds)
    names = {t.name for t in out.trials}
    won: list[str] = []

    def retire(p50s: dict[str, list[float]]) -> list[str]:
        fp32 = p50s.get(base) or []
        for n in sorted(names):
            mine = p50s.get(n) or []
            if fp32 and len(mine) == len(fp32) and mine[-1] < (1.0 - gain) * fp32[-1]:
                won.append(n)
        if won or len(fp32) >= horizon:
            return sorted(names)  # settled, or out of rounds: the benchmark ends
        return [n for n in names if median_cannot_win(fp32, p50s.get(n) or [], horizon, gain)]

    try:
        figures = s.ctx.compare_retiring([s.ctx.baseline, *map(s.candidate, out.trials)], retire)
    except Exception as err:
        if is_user_error(err):
            raise
        out.record["result"] = f"timing failed ({error_text(err)}): calibrating on all rows"
        return
    fp32 = figures[base]["latency_ms"]
    for t in out.trials:
        t.latency, t.fp32 = figures[t.name]["latency_ms"], fp32
    if won:
        out.record["result"] = (
            f"{won[0]} beat FP32 by {gain:.0%} in a round: it may be faster, calibrating on all rows"
        )
        return
    fp32_median = float(np.median(fp32["per_round_p50"]))
    rounds = {t.name: figures[t.name]["latency_ms"]["per_round_p50"] for t in out.trials}
    ratios = {n: float(np.median(r)) / fp32_median for n, r in rounds.items()}
    if any(r < 1.0 - gain for r in ratios.values()):
        out.record["result"] = f"not settled in {horizon} rounds: calibrating on all rows"
        return
    out.slow = True
    rows = out.calibration.samples if out.calibration else 0
    for t in out.trials:
        t.slow_at_any_range = (
            f"{ratios[t.name]:.2f}x FP32 latency (median of {len(rounds[t.name])} interleaved "
            f"rounds), timed on the ranges of {rows} calibration rows before calibrating on all "
            "of them: its speed does not depend on its ranges, so no calibration makes it "
            "faster; not calibrated on the other rows, not evaluated"
        )
        t.budget_reason = "not evaluated (static INT8 cannot be faster than FP32 here)"
    shown = ", ".join(f"{n} {r:.2f}x" for n, r in sorted(ratios.items()))
    out.record["ratios_vs_fp32"] = {n: round(r, 4) for n, r in sorted(ratios.items())}
    out.record["result"] = (
        f"no static candidate can beat FP32 by {gain:.0%} ({shown}): not calibrated on all "
        "rows; the search goes on without them"
    )


def same_graph(statics: list[tuple[QuantSpec, PrecisionPlan]]) -> list[list[int]]:
    """``statics`` (by index) grouped by the graph they write: the same format, ops and float
    nodes, only the calibration (and with it the ranges, constants of that graph) differing.
    The check builds and times the first of each group."""
    groups: dict[tuple[QuantSpec, tuple[str, ...]], list[int]] = {}
    for i, (spec, plan) in enumerate(statics):
        key = (replace(spec, calibration="minmax", percentile=99.99), tuple(plan.float_nodes))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _with_twins(
    statics: list[tuple[QuantSpec, PrecisionPlan]],
    groups: list[list[int]],
    built: list[Trial],
    where: Path,
) -> list[Trial]:
    """Every static setting as a set-aside trial, in ``statics``' order: the first of each group
    as built, the others with the timing and kernels of that file (they were not written)."""
    out: dict[int, Trial] = {}
    for group, first in zip(groups, built, strict=True):
        out[group[0]] = first
        for i in group[1:]:
            spec, plan = statics[i]
            t = Trial(
                spec, plan, where / f"{spec.slug}{plan.tag}.onnx", kernels=dict(first.kernels)
            )
            t.latency, t.fp32, t.budget_reason = first.latency, first.fp32, first.budget_reason
            t.slow_at_any_range = (
                f"not built: the same graph as {first.name}, only its calibration differs; "
                f"that file ran at {first.slow_at_any_range}"
            )
            out[i] = t
    return [out[i] for i in sorted(out)]
