"""QAT against post-training quantization of the same format: FP32, full INT8 PTQ, mixed-precision
PTQ and QAT, with metric, fidelity, latency (measured interleaved), size and INT8 op share."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ...candidate import Candidate, quantizable_graph
from ...context import StepContext
from ...errors import error_text, is_user_error
from ...task import Inputs
from ..quant.calibrate import calibrate
from ..quant.config import CalibrationName, QuantizeConfig, QuantSpec
from ..quant.mixed import mixed_precision
from ..quant.plan import resolve_plan
from ..quant.prepare import prepare
from ..quant.trial import Search, Trial
from .fakequant import FakeQuantFormat

__all__ = ["LATENCY_TOLERANCE", "RECOVERY_TARGET", "PtqRows", "compare_rows", "ptq_rows"]

LATENCY_TOLERANCE = 0.10  # QAT within 10% of full-INT8 PTQ of the same format
RECOVERY_TARGET = 0.70  # share of the metric PTQ lost that QAT should win back


@dataclass
class PtqRows:
    """Post-training candidates of the QAT format: all INT8, and mixed precision from it."""

    full: Trial | None = None
    mixed: Trial | None = None
    notes: list[str] = field(default_factory=list)
    # all INT8 again, calibrated as QAT's ranges start (entropy, percentile): the best PTQ of the
    # format, so that a recovery is also given against it, not only against MinMax
    calibrated: Trial | None = None
    calibration: str = "minmax"


def _eval_inputs(ctx: StepContext) -> Iterable[Inputs]:
    return (inputs for inputs, _ in ctx.task.eval_data())


def ptq_rows(
    ctx: StepContext,
    cand: Candidate,
    fmt: FakeQuantFormat,
    calibration: CalibrationName = "minmax",
    percentile: float = 99.99,
) -> PtqRows:
    """Full static INT8 (every compute node, MinMax calibration, the QAT format and op placement) of ``cand``'s
    float graph, and mixed precision from it when it misses the budget; with another
    ``calibration`` (QAT's), full INT8 calibrated that way too. A failure here costs the
    comparison, never the QAT candidate."""
    try:
        return _ptq_rows(ctx, cand, fmt, calibration, percentile)
    except Exception as err:
        if is_user_error(err):
            raise
        return PtqRows(notes=[f"post-training comparison not built: {error_text(err)}"])


def _ptq_rows(
    ctx: StepContext,
    cand: Candidate,
    fmt: FakeQuantFormat,
    calibration: CalibrationName,
    percentile: float,
) -> PtqRows:
    qcfg = ctx.recipe.step_config(QuantizeConfig)
    prepared = prepare(
        quantizable_graph(cand),
        ctx.workdir / "ptq-prepared",
        ctx.task.sample_inputs(1),
        optimize=qcfg.optimize_graph,
        threads=ctx.threads,
    )
    calib = calibrate(
        prepared.path,
        ctx.task.calibration_data(),
        ctx.workdir / "ptq-calibration",
        samples=qcfg.samples,
        methods={"minmax", calibration},
        percentile=percentile,
        symmetric=qcfg.activation_symmetric,
        chunk_mb=qcfg.calibration_chunk_mb,
        threads=ctx.threads,
        eval_samples=0,
        signature=ctx.task.signature,
    )
    s = Search(ctx, qcfg, prepared, calib.caches, ctx.workdir / "ptq", lambda: _eval_inputs(ctx))
    s.out_dir.mkdir(parents=True, exist_ok=True)
    plan = resolve_plan(prepared.compute_nodes, {}, False)
    spec = QuantSpec(
        mode="static", calibration="minmax", reduce_range=fmt.reduce_range, ops=fmt.ops
    )
    full = s.judge(s.build(spec, plan, "-full"))
    rows = PtqRows(full=full, calibration=calibration)
    if calibration != "minmax":
        other = dataclasses.replace(spec, calibration=calibration, percentile=percentile)
        rows.calibrated = s.judge(s.build(other, plan, f"-full-{calibration}"))
    if full.failure is None and not full.budget_ok and qcfg.mixed_precision:
        rows.mixed = mixed_precision(s, full)
    return rows


def _row(name: str, label: str, quality: Any, kernels: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "metric": quality.metric if quality is not None else None,
        "cosine_mean": quality.cosine_mean if quality is not None else None,
        # the worst declared output's agreement with FP32 (the budget's min_agreement judges it)
        "agreement": quality.agreement if quality is not None else None,
        "int8_share": kernels["int8_share"] if kernels else 0.0,
        "kernels": kernels["summary"] if kernels else "float",
    }


def compare_rows(
    ctx: StepContext, qat: Candidate, kernels: dict[str, Any], ptq: PtqRows | None
) -> dict[str, Any]:
    """The comparison table (rows keyed ``fp32``, ``ptq_full``, ``ptq_mixed``, ``qat``) with the
    verdicts against the targets; rows the run could not build are left out."""
    ref = ctx.reference
    quality = ctx.evaluate(qat) if ctx.evaluate_fn is not None else None
    rows: dict[str, dict[str, Any]] = {
        "fp32": {
            **_row(ctx.baseline.name, "FP32", None, None),
            "metric": ref.metric,
            "cosine_mean": 1.0,
        },
    }
    cands: dict[str, Candidate] = {"fp32": ctx.baseline}
    ptq = ptq or PtqRows()
    for key, trial in (
        ("ptq_full", ptq.full),
        ("ptq_mixed", ptq.mixed),
        ("ptq_full_calibrated", ptq.calibrated),
    ):
        if trial is None or trial.failure is not None:
            continue
        cand = Candidate(trial.name, "quantize", None, onnx=trial.path)
        rows[key] = {**_row(trial.name, trial.label, _all_rows(ctx, trial, cand), trial.kernels)}
        rows[key]["budget_ok"] = trial.budget_ok
        if trial.screened:
            rows[key]["screened_by_search"] = trial.screened
        if key == "ptq_full_calibrated":
            rows[key]["label"] = f"full INT8 PTQ, {ptq.calibration} calibration"
        cands[key] = cand
    rows["qat"] = _row(qat.name, "QAT", quality, kernels)
    cands["qat"] = qat
    if quality is not None:
        rows["qat"]["budget_ok"], rows["qat"]["budget_reason"] = ctx.within_budget(quality)
    latency = _latency(ctx, cands)
    for key, c in cands.items():
        rows[key]["size_bytes"] = c.onnx.stat().st_size if c.onnx is not None else None
        rows[key]["latency_ms"] = latency.get(key)
    out: dict[str, Any] = {"rows": rows, "notes": ptq.notes, "verdicts": _verdicts(rows)}
    if quality is not None:
        out["qat_measurement"] = {
            "metric": {"name": ctx.task.metric_name, "value": quality.metric},
            "fidelity": quality.fidelity_dict(),
            **({"latency_ms": latency["qat"]} if "qat" in latency else {}),
        }
    return out


def _all_rows(ctx: StepContext, trial: Trial, cand: Candidate) -> Any:
    """``trial``'s quality on every evaluation row, as QAT's is measured: the quantize search
    judges a candidate on a subset of the rows first (``screened``) and stops there when the
    subset already misses the budget, and a subset's figure is not comparable with QAT's."""
    if trial.screened is None or ctx.evaluate_fn is None:
        return trial.quality
    return ctx.evaluate(cand)


def _latency(ctx: StepContext, cands: dict[str, Candidate]) -> dict[str, dict[str, Any]]:
    if ctx.compare_fn is None:  # a context without a benchmark (library use, unit tests)
        return {}
    figures = ctx.compare(list(cands.values()))
    return {key: figures[c.name]["latency_ms"] for key, c in cands.items() if c.name in figures}


def _p50(row: dict[str, Any] | None) -> float | None:
    lat = (row or {}).get("latency_ms")
    return float(lat["p50"]) if lat else None


def _verdicts(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Recovered share of what full PTQ lost (metric, cosine and the declared outputs'
    agreement; also against full PTQ with QAT's calibration, ``..._vs_calibrated``, where it was
    built), QAT latency against full PTQ (within 10%) and against mixed precision (faster)."""
    out: dict[str, Any] = {}
    fp32, full, mixed, qat = rows["fp32"], rows.get("ptq_full"), rows.get("ptq_mixed"), rows["qat"]
    for ptq_key, suffix in (("ptq_full", ""), ("ptq_full_calibrated", "_vs_calibrated")):
        ptq = rows.get(ptq_key)
        if ptq is None or qat.get("metric") is None or ptq.get("metric") is None:
            continue
        for key in ("metric", "cosine_mean", "agreement"):
            if ptq.get(key) is None or qat.get(key) is None:
                continue
            lost = (1.0 if key == "agreement" else fp32[key]) - ptq[key]  # FP32 agrees with itself
            out[f"{key}_lost_by_ptq{suffix}"] = lost
            share = (qat[key] - ptq[key]) / lost if lost > 0 else None
            out[f"{key}_recovered_share{suffix}"] = share
    q, f, m = _p50(qat), _p50(full), _p50(mixed)
    if q is not None and f is not None:
        out["latency_vs_ptq_full"] = q / f
        out["within_10pct_of_ptq_full"] = q <= (1.0 + LATENCY_TOLERANCE) * f
    if q is not None and m is not None:
        out["latency_vs_ptq_mixed"] = q / m
        out["faster_than_ptq_mixed"] = q < m
    return out
