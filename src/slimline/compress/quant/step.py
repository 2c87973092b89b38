"""The ``quantize`` step: INT8 post-training quantization that is measured to be faster.

Its config, :class:`~.config.QuantizeConfig`, lives beside it; the rest of this package is the
engine (:mod:`slimline.compress.quant`), and ``docs/quantization.md`` the user guide. The step prepares the graph, calibrates once (in chunks), analyses distributions and
calibration representativeness, then either applies one setting (``mode: static|dynamic``) or
searches (``mode: auto``), and records everything it applied in the candidate's ``meta``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import onnx

from ...candidate import Candidate, quantizable_graph
from ...context import StepContext
from ...cpu import detect as detect_cpu
from ...errors import error_text, is_user_error
from ...records import QuantizeAlternativeRecord, QuantizeRecord, SearchRecord, TrialSummary
from ...steps import Contract, step
from ...task import Inputs
from .auto import all_failed, clearly_smaller, describe, layerwise_for, search
from .calibrate import Calibration, calibrate
from .candidates import candidates, forced, format_warnings
from .config import QuantizeConfig, QuantSpec
from .distribution import analyse, weight_stats
from .mixed import mixed_precision
from .plan import resolve_plan
from .prepare import Prepared, prepare
from .speed_check import SpeedCheck, count_rows, speed_check, wants_speed_check
from .trial import Search, Trial

__all__ = ["QuantizeConfig", "for_openvino", "quantize_step"]

log = logging.getLogger("slimline.quantize")

FEW_SAMPLES = 300


def _source(cand: Candidate, ctx: StepContext) -> tuple[Path, str | None]:
    """The float graph to prepare. A step whose saved graph holds runtime-only fusions (the
    graph step: FusedConv, FusedMatMul, which the quantizer cannot read) names the float graph it
    started from, and that one is prepared instead (same optimizations, applied in quantizable
    form here and again by ONNX Runtime at load time)."""
    assert cand.onnx is not None, "quantize runs on an ONNX candidate"
    source = quantizable_graph(cand)
    if source != Path(cand.onnx):
        return source, (
            f"prepared from {cand.parent}'s float graph: the {cand.step} step's saved runtime "
            "fusions block quantization"
        )
    return Path(cand.onnx), None


def _eval_inputs(ctx: StepContext) -> Iterable[Inputs]:
    return (inputs for inputs, _ in ctx.task.eval_data())


def _calibrate(
    cfg: QuantizeConfig,
    prepared: Prepared,
    methods: set[str],
    ctx: StepContext,
    more: bool = False,
    rows: int | None = None,
) -> Calibration:
    """One calibration pass for ``methods``. ``more``: the search's follow-up for methods not run
    up front (its own folder; representativeness and the few-samples warning were given once).
    ``rows``: the speed check's few rows (:mod:`.speed_check`; its own folder, ranges only)."""
    first = not more and rows is None
    calib = calibrate(
        prepared.path,
        ctx.task.calibration_data(),
        ctx.workdir / ("calibration" if first else "calibration-more" if more else "speed-check"),
        samples=rows or cfg.samples,
        methods=methods,
        percentile=cfg.percentile,
        symmetric=cfg.activation_symmetric,
        chunk_mb=cfg.calibration_chunk_mb,
        threads=ctx.threads,
        eval_batches=_eval_inputs(ctx) if first else None,
        eval_samples=cfg.representativeness_samples,
        signature=ctx.task.signature,
    )
    if calib.samples < FEW_SAMPLES and first:
        ctx.warn(
            f"quantize: calibrated on {calib.samples} samples (fewer than {FEW_SAMPLES}); ranges "
            "may miss rare activations: give calibration_data() more samples"
        )
    return calib


def _search_for(
    cfg: QuantizeConfig, prepared: Prepared, tries: list[tuple[QuantSpec, Any]], ctx: StepContext
) -> tuple[Search, Calibration, SpeedCheck | None, list[tuple[QuantSpec, Any]]]:
    """The search, on the ranges it builds on (:func:`_ranges`), and the settings it still
    tries: without the static ones where the speed check set them aside."""
    s = Search(ctx, cfg, prepared, {}, ctx.workdir / "candidates", lambda: _eval_inputs(ctx))
    s.out_dir.mkdir(parents=True, exist_ok=True)
    calib, check = _ranges(cfg, prepared, tries, s)
    if check is not None and check.slow:
        tries = [t for t in tries if t[0].mode != "static"]
        s.slow_statics, s.caches = check.trials, {}  # nothing static is built from here on
    else:
        s.caches = calib.caches
    s.calibrate_more = lambda extra: _calibrate(cfg, prepared, extra, ctx, more=True).caches
    return s, calib, check, tries


def _ranges(
    cfg: QuantizeConfig, prepared: Prepared, tries: list[tuple[QuantSpec, Any]], s: Search
) -> tuple[Calibration, SpeedCheck | None]:
    """The calibration the search builds on, and the speed check's findings where it ran
    (:mod:`.speed_check`): the check's few rows when no static candidate can be faster than
    FP32 (nothing static is built on them again), a pass over every row otherwise."""
    ctx = s.ctx
    check = None
    methods: set[str] = {t.calibration for t, _ in tries if t.mode == "static"} or {"minmax"}
    if wants_speed_check(cfg, ctx.recipe.budget.objective, tries):
        statics = [t for t in tries if t[0].mode == "static"]
        few = cfg.speed_check_rows
        with s.timed("speed_check"):
            rows = count_rows(ctx.task.calibration_data(), cfg.samples, ctx.task.signature)
            check = speed_check(
                s, statics, lambda: _calibrate(cfg, prepared, methods, ctx, rows=few), rows
            )
        if check.slow and check.calibration is not None:
            return check.calibration, check
    return _calibrate(cfg, prepared, methods, ctx), check


def _calibration_summary(calib: Calibration, check: SpeedCheck | None) -> dict[str, Any]:
    out = calib.summary()
    if check is not None and check.slow:
        out["note"] = (
            f"the speed check's {calib.samples} rows only: no static candidate could be faster "
            "than FP32, so nothing was calibrated on all rows (the distributions are of these rows)"
        )
    return out


def _ranges_used(chosen: Trial) -> set[str]:
    """Tensors whose calibrated range the chosen model bakes in: the inputs of its static
    QuantizeLinear nodes. A dynamic model computes its ranges per input and uses none."""
    if chosen.spec.mode != "static":
        return set()
    model = onnx.load(str(chosen.path), load_external_data=False)
    return {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}


def _warn_representativeness(ctx: StepContext, rep: dict[str, Any], chosen: Trial) -> None:
    """Warn about evaluation inputs leaving the calibrated ranges only where it matters: on the
    tensors whose calibrated range the chosen model uses (all are kept in the manifest)."""
    flagged = rep.get("flagged", [])
    if not flagged:
        return
    used = _ranges_used(chosen)
    hit = [f for f in flagged if f["tensor"] in used]
    rep["flagged_in_chosen"] = [f["tensor"] for f in hit]
    if not hit:
        rep["note"] = (
            f"{len(flagged)} tensors often exceed their calibrated range on evaluation inputs, "
            f"but the chosen {chosen.spec.mode} model does not quantize with those ranges"
        )
        return
    names = ", ".join(f"{f['tensor']} ({f['exceed_share']:.0%})" for f in hit[:5])
    ctx.warn(
        f"quantize: evaluation inputs often exceed the calibrated ranges of {len(hit)} tensors "
        f"the chosen model quantizes with: {names}; calibrate on data that looks like what is "
        "served"
    )


@step(
    QuantizeConfig,
    contract=Contract(consumes=("onnx",), produces=("onnx-int8",)),
    version=10,  # 2: equal-speed candidates of one size go to the more faithful; 3: inf/NaN activations calibrated on their finite values; 4: float nodes read their own per-axis DequantizeLinear (ONNX Runtime no longer quantizes their weights at load); auto mode also tries Q/DQ around the compute ops only on convolutional graphs; 5: mixed precision tries nodes by measured output gain per cost (compress/quant/impact.py); 6: trials screened on a subset of the evaluation rows (measure/screen.py), the search records why it stopped; 7: nncf: true also builds NNCF's documented OpenVINO path (compress/nncf_ov.py), the ONNX-backend model from an opset-13 graph, both with the overflow fix on x86 without VNNI; a target on OpenVINO only gets no UINT8-weight QDQ (OpenVINO runs it in float); 8: a trial whose median can no longer beat FP32's is timed on fewer rounds, the layer-wise table reuses mixed precision's and is left out for a candidate that cannot be kept; 9: with no trial within budget, trials are timed on at most 3 rounds, only to rank them; 10: with dynamic candidates beside them, the static ones are timed on a few rows' ranges before the full calibration, which runs only when one can be faster (compress/quant/speed_check.py); no layer-wise table for a trial the paired rounds reject
    reads=("target", "budget", "outputs", "metric", "bench"),
    packages=("onnx", "onnxruntime", "numpy"),
)
def quantize_step(cfg: QuantizeConfig, cand: Candidate, ctx: StepContext) -> Candidate:
    t0 = time.perf_counter()
    src, note = _source(cand, ctx)
    sample = ctx.task.sample_inputs(1)
    prepared = prepare(
        src, ctx.workdir / "prepared", sample, optimize=cfg.optimize_graph, threads=ctx.threads
    )
    if note:
        prepared.notes.insert(0, note)
    t_prep = time.perf_counter() - t0
    plan = resolve_plan(prepared.compute_nodes, cfg.precision, cfg.keep_first_last_float)
    tries = candidates(cfg, prepared, plan) if cfg.mode == "auto" else forced(cfg, prepared, plan)
    tries = for_openvino(tries, ctx.recipe.target.runtime)
    for risk in format_warnings((sp for sp, _ in tries), detect_cpu()):
        ctx.warn(f"quantize: {risk}")
    s, calib, check, tries = _search_for(cfg, prepared, tries, ctx)
    dist = analyse(calib, weight_stats(prepared.path, plan.int8_nodes))
    if cfg.mode == "auto":
        chosen, rejected, record = search(s, tries)
    else:
        chosen, rejected, record = _single(s, plan, tries[0][0])
    _warn_representativeness(ctx, calib.representativeness, chosen)
    with s.timed("layerwise"):
        rows = _layerwise(s, chosen)
    record["candidates"] = [_trial_summary(s, t) for t in s.trials]
    if check is not None:
        record["speed_check"] = check.record
    d = describe(s, chosen, rows)
    meta = QuantizeRecord(
        mode=cfg.mode,
        config=d["config"],
        label=d["label"],
        precision_map=d["precision_map"],
        kernels=d["kernels"],
        fallback_report=d["fallback_report"],
        layerwise=d["layerwise"],
        layerwise_statement=d["layerwise_statement"],
        latency_ratio_vs_fp32=d["latency_ratio_vs_fp32"],
        notes=d["notes"],
        prepared=prepared.summary(),
        calibration=_calibration_summary(calib, check),
        representativeness=calib.representativeness,
        distributions=dist,
        search=record,
        step_wall_s=round(time.perf_counter() - t0, 2),
        timings_s={
            "prepare": round(t_prep, 3),
            "calibrate": 0.0 if check and check.slow else round(calib.wall_s, 3),
            **s.timings,
        },
    )
    if "no_candidate_met_budget" in record:
        meta["no_candidate_met_budget"] = record["no_candidate_met_budget"]
        ctx.warn(f"quantize: {record['no_candidate_met_budget']}")
    for t in [chosen, *rejected]:
        for n in t.notes:
            ctx.warn(f"quantize: {n}")
    ctx.alternatives.extend(_alternative(s, t, chosen, cand.name) for t in rejected)
    if cfg.nncf:  # NNCF's ONNX backend, and its documented OpenVINO path (..nncf_ov)
        from ..nncf_ov import nncf_ov_alternative
        from ..nncf_ptq import nncf_alternative

        ctx.alternatives.append(nncf_alternative(cand, ctx, cfg.samples))
        ctx.alternatives.append(nncf_ov_alternative(cand, ctx, cfg.samples))
    out = Candidate(
        name="quantize",
        step="quantize",
        parent=cand.name,
        onnx=chosen.path,
        module=None,
        meta=dict(meta),
        reason=s.reason(chosen) if chosen.latency else chosen.budget_reason,
        measurement=_measurement(ctx, chosen),
    )
    if cfg.fallback == "qat":
        from ..qat.fallback import qat_fallback

        return qat_fallback(cfg, cand, ctx, chosen, record, out)
    return out


def for_openvino(tries: list[tuple[QuantSpec, Any]], runtime: str) -> list[tuple[QuantSpec, Any]]:
    """The QDQ settings worth building for a target that runs only OpenVINO: those with 8-bit
    signed weights (7-bit where the CPU kind chose them). OpenVINO runs a QDQ file with UINT8
    weights (U8U8, tried without VNNI for ONNX Runtime) in float, with no INT8 gain
    (bench/RESULTS-ov-int8.md); it stays where nothing else is left."""
    if runtime != "openvino":
        return tries
    signed = [t for t in tries if t[0].mode != "static" or t[0].weight_type == "int8"]
    return signed or tries


def _layerwise(s: Search, chosen: Trial) -> list[dict[str, Any]]:
    """The chosen model's layer-wise error; a failure there costs the table, not the step."""
    try:
        return layerwise_for(s, chosen)
    except Exception as err:
        if is_user_error(err):
            raise
        chosen.notes.append(f"layer-wise error not measured: {error_text(err)}")
        return []


def _single(s: Search, plan: Any, spec: QuantSpec) -> tuple[Trial, list[Trial], SearchRecord]:
    trial = s.judge(s.build(spec, plan))
    s.trials = [trial]
    if trial.failure is not None:
        raise all_failed(s)
    record: SearchRecord = {}
    if not trial.budget_ok and s.cfg.mixed_precision:
        mixed = mixed_precision(s, trial)
        if mixed is not None and mixed is not trial:
            s.trials.append(mixed)
            if mixed.budget_ok:
                trial = mixed
    record["mixed_precision"] = s.mixed_trace
    record["stopped"] = "the one setting the recipe names" + (
        "" if trial.budget_ok else ", with mixed precision where it missed the budget"
    )
    if not trial.budget_ok:
        record["no_candidate_met_budget"] = f"{trial.spec.label}: {trial.budget_reason}"
    return trial, [t for t in s.trials if t is not trial], record


def _measurement(ctx: StepContext, t: Trial) -> dict[str, Any] | None:
    if t.quality is None:
        return None
    out: dict[str, Any] = {
        "metric": {"name": ctx.task.metric_name, "value": t.quality.metric},
        "fidelity": t.quality.fidelity_dict(),
    }
    if t.screened:  # its figures are those of the rows it was screened out on
        out["fidelity"]["rows"] = t.screened
    if t.latency is not None:
        out["latency_ms"] = t.latency
    if t.latency is not None and t.fp32 is not None and t.cpu_p50 is not None:
        # the search's interleaved rounds against FP32: the verdict against the same FP32 on
        # the same runtime reads them instead of timing the pair again (pipeline/judge.py)
        out["timed_with_baseline"] = {
            "against": ctx.baseline.name,
            "baseline_latency_ms": t.fp32,
            "cpu_p50_ms": t.cpu_p50[0],
            "baseline_cpu_p50_ms": t.cpu_p50[1],
        }
    return out


def _trial_summary(s: Search, t: Trial) -> TrialSummary:
    return {
        "name": t.name,
        "label": t.label,
        "float_nodes": len(t.plan.float_nodes),
        "kernels": t.kernels["summary"],
        "latency_p50_ms": t.latency["p50"] if t.latency else None,
        "fp32_p50_ms": t.fp32["p50"] if t.fp32 else None,
        "ratio_vs_fp32": round(s.ratio(t), 4) if t.latency and t.fp32 else None,
        "faster_than_fp32": s.faster(t),
        "bands_separated": s.separated(t),
        "budget_ok": t.budget_ok,
        "fidelity": t.quality.fidelity_dict() if t.quality else None,
        "metric": t.quality.metric if t.quality else None,
        "failure": t.failure,
        "screened": t.screened,
        "timing_stopped": t.timing_stopped,
        "slow_at_any_range": t.slow_at_any_range,
        "size_bytes": t.size if t.path.is_file() else None,  # a failed trial has no file
    }


def _tie_reason(s: Search, t: Trial, chosen: Trial) -> str:
    """Why ``chosen`` won over ``t``, which was at least as fast: what decided, named."""
    speeds = f"{s.ratio(chosen):.2f}x vs {s.ratio(t):.2f}x FP32 latency"
    sizes = f"{chosen.size / 1e6:.1f} vs {t.size / 1e6:.1f} MB"
    if s.objective == "size" or clearly_smaller(chosen.size, t.size, s.ctx.recipe.budget.min_gain):
        return (
            f"within budget, but {chosen.name} is smaller ({sizes}) at {speeds} "
            f"(objective: {s.objective})"
        )
    cos = (
        f"cosine {chosen.quality.cosine_mean:.4f} vs {t.quality.cosine_mean:.4f}"
        if chosen.quality and t.quality
        else "fidelity"
    )
    return (
        f"within budget, but {chosen.name} is as fast ({speeds}), no larger ({sizes}) and "
        f"more faithful ({cos}) (objective: {s.objective})"
    )


def _alternative(s: Search, t: Trial, chosen: Trial, parent: str) -> Candidate:
    reason = s.reason(t) if s.cfg.mode == "auto" else f"not chosen: {t.budget_reason}"
    if t.failure is not None:
        reason = s.reason(t)
    if t.latency and t.budget_ok and s.faster(t):
        reason = (
            f"faster than FP32 and within budget, but slower than {chosen.name}: "
            f"{s.ratio(t):.2f}x vs {s.ratio(chosen):.2f}x FP32 latency"
        )
        if chosen.latency and chosen.p50() >= t.p50():  # the tie-break or the size objective
            reason = _tie_reason(s, t, chosen)
    return Candidate(
        name=t.name,
        step="quantize",
        parent=parent,
        onnx=t.path if t.path.is_file() else None,  # a trial that failed to build may have none
        accepted=False,
        reason=reason,
        meta=dict(
            QuantizeAlternativeRecord(
                config=t.spec.to_dict(),
                label=t.label,
                kernels=t.kernels,
                precision_map=t.plan.to_dict(),
                fallback_report=t.kernels["summary"],
            )
        ),
        measurement=_measurement(s.ctx, t),
    )
