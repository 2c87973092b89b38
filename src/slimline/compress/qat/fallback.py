"""``quantize: {fallback: qat}``: quantization-aware training when post-training quantization plus
mixed precision misses the budget, or meets it only by keeping more than ``max_float_share`` of
the compute ops in float. On an ONNX task QAT trains the float graph converted to torch
(``onnx_module.py``); a graph it cannot convert rejects QAT with the op named, and PTQ stands. QAT runs with the ``qat`` step's defaults (the quantize step's cache key
does not read other steps' settings); the better of the two is returned, the other is recorded as an alternative."""

from __future__ import annotations

from dataclasses import replace

from ...candidate import Candidate
from ...context import StepContext
from ...errors import error_text, is_user_error
from ...records import SearchRecord
from ..quant.config import QuantizeConfig
from ..quant.trial import Trial
from .compare import ptq_rows
from .fakequant import format_for
from .step import QatConfig, run_qat

__all__ = ["qat_fallback", "why_qat"]


def why_qat(cfg: QuantizeConfig, chosen: Trial, record: SearchRecord) -> str | None:
    """Why post-training quantization is not good enough, or ``None`` when it is."""
    if "no_candidate_met_budget" in record or not chosen.budget_ok:
        return f"post-training quantization missed the budget ({chosen.budget_reason})"
    float_share = 1.0 - float(chosen.kernels.get("int8_share", 0.0))
    if float_share > cfg.max_float_share:
        return (
            f"post-training quantization met the budget only with {float_share:.0%} of the "
            f"compute ops in float (max_float_share {cfg.max_float_share:.0%})"
        )
    return None


def qat_fallback(
    cfg: QuantizeConfig,
    cand: Candidate,
    ctx: StepContext,
    chosen: Trial,
    record: SearchRecord,
    ptq: Candidate,
) -> Candidate:
    """``ptq`` (the quantize step's pick) or, where PTQ is not good enough and QAT does better,
    the QAT candidate; the one not returned goes to ``ctx.alternatives``."""
    why = why_qat(cfg, chosen, record)
    if why is None:
        ptq.meta["qat_fallback"] = "not needed: post-training quantization met the budget"
        return ptq
    check = record.get("speed_check") or {}
    if check.get("slow"):  # QAT's INT8 runs the same kernels: it cannot be faster either
        ptq.meta["qat_fallback"] = (
            f"{why}; QAT skipped: no static INT8 candidate can be faster than FP32 on this CPU "
            f"({check['result']})"
        )
        ctx.warn(f"quantize: {ptq.meta['qat_fallback']}")
        return ptq
    if cand.module is None and not ctx.task.is_onnx:
        ptq.meta["qat_fallback"] = f"{why}; QAT skipped: {cand.name} has no torch model"
        ctx.warn(f"quantize: {ptq.meta['qat_fallback']}")
        return ptq
    from ...cpu import detect as detect_cpu

    try:
        # QAT simulates the op placement PTQ used
        qat_cfg = QatConfig().model_copy(update={"quantize_ops": cfg.quantize_ops})
        rows = ptq_rows(ctx, cand, format_for(detect_cpu(), qat_cfg.quantize_ops))
        qat = run_qat(qat_cfg, cand, ctx, rows)
    except Exception as err:
        if is_user_error(err):
            raise
        ptq.meta["qat_fallback"] = f"{why}; QAT failed: {error_text(err)}"
        ctx.warn(f"quantize: {ptq.meta['qat_fallback']}")
        ctx.alternatives.append(_failed(cand, why, ptq, err))
        return ptq
    qat.meta["fallback_from"] = {"why": why, "ptq": ptq.name, "ptq_reason": ptq.reason}
    ok = qat.meta["comparison"]["rows"]["qat"].get("budget_ok", False)
    if ok:
        ptq.meta["qat_fallback"] = f"{why}; QAT within budget, chosen instead"
        ctx.alternatives.append(
            replace(ptq, accepted=False, reason=f"not chosen: {why}; QAT met the budget")
        )
        qat.reason = f"QAT fallback: {why}"
        return qat
    ptq.meta["qat_fallback"] = f"{why}; QAT missed the budget too"
    reason = qat.meta["comparison"]["rows"]["qat"].get("budget_reason", "over budget")
    ctx.alternatives.append(replace(qat, accepted=False, reason=f"QAT fallback: {reason}"))
    return ptq


def _failed(cand: Candidate, why: str, ptq: Candidate, err: Exception) -> Candidate:
    """The QAT candidate that could not be built (e.g. an ONNX op the converter does not cover),
    rejected with the error; the run records it beside the PTQ pick."""
    return Candidate(
        name="qat",
        step="qat",
        parent=cand.name,
        accepted=False,
        reason=f"QAT fallback failed: {error_text(err)}",
        meta={
            "failure": {"type": type(err).__name__, "error": error_text(err)},
            "fallback_from": {"why": why, "ptq": ptq.name, "ptq_reason": ptq.reason},
        },
    )
