"""Automatic mode: build candidate settings suited to the model (:mod:`.candidates`), measure
them all interleaved against FP32 (:mod:`.trial`), keep the fastest within budget; keep the
worst layers in float when none is (:mod:`.mixed`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...context import StepContext
from ...errors import StepError, error_text, is_user_error
from ...measure.latency import speed_verdict
from ...measure.quality import Quality
from ...records import SearchRecord, TrialDescription
from .config import CalibrationName, QuantSpec
from .layerwise import error_statement
from .mixed import mixed_from_fastest
from .plan import PrecisionPlan
from .trial import Search, Trial

__all__ = [
    "all_failed",
    "clearly_smaller",
    "describe",
    "latency_ties",
    "layerwise_for",
    "pick",
    "recalibrate_near_miss",
    "search",
    "shortfall",
]

CALIBRATIONS: tuple[CalibrationName, ...] = ("minmax", "percentile", "entropy")


def search(
    s: Search, tries: list[tuple[QuantSpec, PrecisionPlan]]
) -> tuple[Trial, list[Trial], SearchRecord]:
    """Build and evaluate every spec; time (interleaved with FP32) those within budget, or all of
    them when none is; when none qualifies, a near miss recalibrated
    (:func:`recalibrate_near_miss`), then mixed precision from the fastest.

    Returns (chosen, rejected, record)."""
    with s.timed("quantize"):
        s.trials = [*s.slow_statics, *(s.build(spec, plan, plan.tag) for spec, plan in tries)]
    with s.timed("evaluate"):
        for t in s.usable():
            s.judge(t)
    in_budget = [t for t in s.usable() if t.budget_ok]
    with s.timed("compare"):
        s.measure(in_budget or s.usable(), rank_only=not in_budget)
        if not any(t.latency for t in s.usable()):  # those within budget all failed to time
            s.measure([t for t in s.usable() if t.latency is None], rank_only=True)
    if not any(t.latency for t in s.usable()):
        raise all_failed(s)
    good = [t for t in in_budget if s.faster(t) or s.objective == "size"]
    if not good:
        with s.timed("recalibrate"):
            good = recalibrate_near_miss(s)
    mixed_tried = not good and s.cfg.mixed_precision
    if mixed_tried:
        untimed = [t for t in s.usable() if t.latency is None]
        if untimed:
            with s.timed("compare"):
                # mixed precision starts from the fastest, in budget or not: a ranking
                s.measure(untimed, rank_only=True)
        with s.timed("mixed_precision"):
            mixed = mixed_from_fastest(s)
        if mixed is not None:
            s.trials.append(mixed)
            if mixed.budget_ok and s.faster(mixed):
                good = [mixed]
    record: SearchRecord = {"fp32_latency_ms": next((t.fp32 for t in s.trials if t.fp32), None)}
    record["mixed_precision"] = s.mixed_trace
    if s.recalibration:
        record["recalibration"] = s.recalibration
    if good:
        chosen = pick(good, s.objective, s.ctx.recipe.budget.min_gain)
    else:
        chosen = _best_effort(s)
        record["no_candidate_met_budget"] = _why_none(s)
    record["stopped"] = _stopped(s, good, mixed_tried)
    rejected = [t for t in s.trials if t is not chosen]
    return chosen, rejected, record


def shortfall(q: Quality, ctx: StepContext) -> float:
    """How far ``q`` misses the budget's fidelity floors, as a share of their allowance (the
    declared agreement below ``min_agreement`` over ``1 - min_agreement``, the judged cosine
    below ``min_cosine`` over ``1 - min_cosine``; the worse of them); 0 when it meets them."""
    b = ctx.recipe.budget
    if q.agreement is None:
        pairs = [(float(q.cosine_mean), b.min_cosine)]
    else:
        pairs = [(float(q.agreement), b.min_agreement)]
        if q.cosine_judged is not None:
            pairs.append((float(q.cosine_judged), b.min_cosine))
    return max(max(0.0, (floor - v) / max(1.0 - floor, 1e-9)) for v, floor in pairs)


def recalibrate_near_miss(s: Search) -> list[Trial]:
    """Nothing qualified: the static candidate faster than FP32 that misses the budget by the
    least, when that is at most ``recalibrate_near_miss`` of the budget's allowance
    (:func:`shortfall`), is rebuilt with each calibration no candidate used (entropy: the search
    calibrates MinMax and Percentile up front; Entropy's threshold search costs more). A narrow
    miss is often a few flips where FP32 itself nearly ties (a CTC frame whose two best scores
    are close): which ones flip depends on every range, so another calibration is a cheap second
    draw, where keeping some nodes in float moves little. The rebuilt trials join
    ``s.trials`` (those within budget timed on every round); ``s.recalibration`` records what
    was done and why. Returns those that qualify."""
    share = s.cfg.recalibrate_near_miss
    if share <= 0 or s.calibrate_more is None:
        return []
    static = [
        t for t in s.usable() if t.spec.mode == "static" and not t.plan.tag.startswith("-mixed")
    ]
    missed = {t.name: shortfall(t.quality, s.ctx) for t in static if t.quality and s.faster(t)}
    near = [t for t in static if t.name in missed and not t.screened and missed[t.name] <= share]
    methods = [m for m in CALIBRATIONS if m not in {t.spec.calibration for t in static}]
    if not near or not methods:
        why = (
            f"every calibration ({', '.join(CALIBRATIONS)}) was tried"
            if near
            else f"no static candidate faster than FP32 misses the budget by at most {share:g} "
            "of its allowance"
        )
        s.recalibration = {"skipped": why}
        return []
    base = min(near, key=lambda t: missed[t.name])
    s.recalibration = {
        "from": base.name,
        "missed_by": round(missed[base.name], 4),
        "reason": base.budget_reason,
        "methods": methods,
    }
    try:
        s.caches.update(s.calibrate_more(set(methods)))
    except Exception as err:  # the extra calibration failed: mixed precision goes on as before
        if is_user_error(err):
            raise
        s.recalibration["result"] = f"{'/'.join(methods)} calibration failed: {error_text(err)}"
        return []
    new = [
        s.judge(s.build(replace(base.spec, calibration=m), base.plan, base.plan.tag))
        for m in methods
    ]
    s.trials.extend(new)
    s.measure([t for t in new if t.budget_ok])
    for t in new:
        if t.latency is None and not t.budget_ok:
            t.not_timed = "a recalibrated near miss over budget cannot be chosen for speed"
    good = [t for t in new if t.budget_ok and (s.faster(t) or s.objective == "size")]
    s.recalibration["trials"] = [{"name": t.name, "reason": s.reason(t)} for t in new]
    verdict = "met the budget" if good else "did not qualify"
    s.recalibration["result"] = (
        f"{base.name} missed the budget by {missed[base.name]:.2f} of its allowance; "
        f"recalibrated ({', '.join(methods)}): {verdict}"
    )
    return good


def pick(good: list[Trial], objective: str, min_gain: float) -> Trial:
    """The chosen one of the candidates that qualified. Objective ``size``: the smallest file.
    Objective ``latency``: the candidates that run as fast as the fastest median as far as this
    run can tell (the fastest one does not pass the pipeline's own speed test against them:
    ``min_gain`` faster at the median of per-round ratios, confirmed by separated bands or the
    sign test over the interleaved rounds) are ties; of those, the ones whose file is within
    ``min_gain`` of the smallest tie's; of those, the most faithful (mean cosine to FP32), the
    faster median breaking a tie. Which of two equally fast candidates has the lower median is
    noise; a file ``min_gain`` smaller is not, and neither is fidelity."""
    if objective == "size":
        return min(good, key=lambda t: (t.size, t.p50() if t.latency else 0.0))
    ties = latency_ties(good, min_gain)
    smallest = min(t.size for t in ties)
    small = [t for t in ties if not clearly_smaller(smallest, t.size, min_gain)]
    return max(small, key=lambda t: (t.quality.cosine_mean if t.quality else -1.0, -t.p50()))


def latency_ties(good: list[Trial], min_gain: float) -> list[Trial]:
    """The fastest median and every candidate it is not measurably faster than."""
    fastest = min(good, key=lambda t: t.p50())
    best = fastest.latency
    assert best is not None

    def as_fast(t: Trial) -> bool:
        assert t.latency is not None
        return speed_verdict(t.latency, best, min_gain)[0] != "faster"

    return [t for t in good if t is fastest or as_fast(t)]


def clearly_smaller(size: int, other: int, min_gain: float) -> bool:
    """Whether a file of ``size`` bytes is at least ``min_gain`` smaller than one of ``other``."""
    return size <= (1.0 - min_gain) * other


def _best_effort(s: Search) -> Trial:
    """Nothing qualified: the fastest-to-FP32 candidate that is at least faster, closest to budget."""
    timed = [t for t in s.usable() if t.latency is not None]
    faster = [t for t in timed if s.faster(t)] or timed
    return max(faster, key=lambda t: (t.quality.cosine_mean if t.quality else -1.0, -t.p50()))


def all_failed(s: Search) -> StepError:
    """The step's error when no trial could be built, checked, evaluated and timed: the step is
    rejected and the pipeline keeps its parent; every trial's reason is in the message."""
    reasons = " | ".join(t.failure or s.reason(t) for t in s.trials)
    return StepError(
        f"every quantized candidate failed ({len(s.trials)}): {reasons}",
        details={"candidates": [{"name": t.name, "reason": s.reason(t)} for t in s.trials]},
    )


def _stopped(s: Search, good: list[Trial], mixed_tried: bool) -> str:
    """Why the search ended where it did, for the manifest."""
    screened = [t for t in s.trials if t.screened]
    rows = (
        f" ({len(screened)} of {len(s.trials)} trials over budget on a subset of the "
        f"evaluation rows, not evaluated on the rest)"
        if screened
        else ""
    )
    recal = f"{s.recalibration['result']}; " if "result" in s.recalibration else ""
    if good and not mixed_tried:
        why = f"{len(good)} of {len(s.trials)} candidates faster than FP32 and within budget"
        return f"{recal}{why}; mixed precision not needed{rows}"
    if not s.cfg.mixed_precision:
        return (
            f"{recal}no candidate faster than FP32 and within budget; mixed precision is off{rows}"
        )
    ends = [e for e in s.mixed_trace if "result" in e or "skipped" in e]
    last: dict[str, Any] = ends[-1] if ends else {}
    why = str(last.get("result") or last.get("skipped") or "mixed precision found no plan")
    verdict = "met the budget" if good else "did not meet the budget"
    return f"{recal}mixed precision {verdict}: {why}{rows}"


def _why_none(s: Search) -> str:
    parts = [f"{t.name}: {s.reason(t)}" for t in s.trials]
    return "no candidate is both faster than FP32 and within budget; " + " | ".join(parts)


def describe(s: Search, trial: Trial, rows: list[dict[str, Any]]) -> TrialDescription:
    """The record of one trial for ``Candidate.meta``."""
    return {
        "config": trial.spec.to_dict(),
        "label": trial.label,
        "precision_map": trial.plan.to_dict(),
        "kernels": trial.kernels,
        "fallback_report": trial.kernels["summary"],
        "layerwise": rows,
        "layerwise_statement": error_statement(rows) if rows else s.layerwise_skipped,
        "latency_ratio_vs_fp32": round(s.ratio(trial), 4) if trial.latency and trial.fp32 else None,
        "notes": trial.notes,
    }


def layerwise_for(s: Search, trial: Trial) -> list[dict[str, Any]]:
    """The chosen trial's layer-wise table: mixed precision's where it ranked this same file;
    not measured in automatic mode for a trial over budget or not measurably faster than FP32
    (no INT8 model of this search can be kept, and mixed precision, which ranks by it, is
    over), with the reason as the record's ``layerwise_statement``. On an AVX2-only CPU, where
    INT8 often runs slower than FP32, the table took 30 s of a CTC recognizer's 143 s step."""
    if trial.path in s.layer_rows or s.cfg.mode != "auto":
        return s.layer_errors(trial)
    if not trial.budget_ok:
        why = f"is over budget ({trial.budget_reason})"
    elif trial.latency is not None and trial.fp32 is not None and not s.faster(trial):
        why = f"is not measurably faster than FP32 ({s.ratio(trial):.2f}x its latency)"
    elif (paired := _rounds_miss_the_gain(s, trial)) is not None:
        why = (
            f"misses the {s.ctx.recipe.budget.min_gain:.0%} gain round by round (median "
            f"per-round ratio {paired:.2f} to FP32 over the search's interleaved rounds): by "
            "the run's own speed test it is not measurably faster than FP32"
        )
    else:
        return s.layer_errors(trial)
    s.layerwise_skipped = (
        f"layer-wise error not measured: {trial.label} {why}; the table is measured for a "
        "chosen candidate within budget and faster than FP32"
    )
    return []


def _rounds_miss_the_gain(s: Search, trial: Trial) -> float | None:
    """The median per-round ratio of ``trial`` to FP32 where the search timed both on the same
    rounds and that ratio alone makes the pipeline's verdict ``not faster``
    (:func:`~slimline.measure.latency.speed_verdict`); None otherwise. The search's own test
    (:meth:`~.trial.Search.faster`) compares medians, which can pass where the paired ratio
    does not."""
    if trial.latency is None or trial.fp32 is None:
        return None
    ours, theirs = trial.latency.get("per_round_p50") or [], trial.fp32.get("per_round_p50") or []
    if not ours or len(ours) != len(theirs):
        return None
    verdict, pair = speed_verdict(trial.fp32, trial.latency, s.ctx.recipe.budget.min_gain)
    return float(pair["ratio"]) if verdict == "not faster" else None
