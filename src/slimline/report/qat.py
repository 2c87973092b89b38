"""Report section of quantization-aware training: FP32, full PTQ, mixed-precision PTQ and QAT."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from . import section
from .html import fmt, table

__all__ = ["qat_comparison"]

_ROWS = (
    ("fp32", "FP32"),
    ("ptq_full", "full INT8 PTQ"),
    ("ptq_full_calibrated", "full INT8 PTQ, QAT's calibration"),
    ("ptq_mixed", "PTQ, mixed precision"),
)


def _qat_candidates(m: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in m.get("candidates", []) if "comparison" in (c.get("meta") or {})]


def _cells(label: str, row: dict[str, Any]) -> list[Any]:
    lat = row.get("latency_ms") or {}
    size = row.get("size_bytes")
    return [
        html.escape(label),
        fmt(row.get("metric")),
        fmt(row.get("cosine_mean"), 5),
        fmt(lat.get("p50")),
        f"{size / 1e6:.2f} MB" if size else "n/a",
        f"{row.get('int8_share', 0.0):.0%} ({html.escape(str(row.get('kernels', '')))})",
    ]


def _verdicts(v: dict[str, Any]) -> str:
    parts = []
    if v.get("metric_recovered_share") is not None:
        parts.append(f"metric PTQ lost, recovered by QAT: {v['metric_recovered_share']:.0%}")
    if v.get("cosine_mean_recovered_share") is not None:
        parts.append(f"cosine recovered: {v['cosine_mean_recovered_share']:.0%}")
    if v.get("metric_recovered_share_vs_calibrated") is not None:
        parts.append(
            "against full PTQ with QAT's calibration: metric "
            f"{v['metric_recovered_share_vs_calibrated']:.0%}, cosine "
            f"{v.get('cosine_mean_recovered_share_vs_calibrated') or 0.0:.0%}"
        )
    if "latency_vs_ptq_full" in v:
        parts.append(f"QAT latency {v['latency_vs_ptq_full']:.2f}x full PTQ")
    if "latency_vs_ptq_mixed" in v:
        parts.append(f"{v['latency_vs_ptq_mixed']:.2f}x mixed-precision PTQ")
    return "; ".join(parts)


def _export_text(meta: dict[str, Any]) -> str:
    c = meta.get("export_check") or {}
    if not c:
        return ""
    return (
        f"QDQ export ({c.get('exporter')}): ONNX Runtime vs the fake-quant model on "
        f"{c.get('rows')} rows, mean cosine {c.get('cosine_mean', 0.0):.5f} (min "
        f"{c.get('cosine_min', 0.0):.5f}); {c.get('int8_weights', 0)} weights stored INT8."
        + _floor_text(c)
    )


def _floor_text(c: dict[str, Any]) -> str:
    if c.get("passed_by") != "noise floor":
        return ""
    return (
        f" Below the {c.get('bound')} bound, but the fake-quant model itself agrees only to "
        f"{c.get('noise_floor_cosine', 0.0):.5f} with its own outputs when every value it "
        "quantizes moves by 1e-6 of itself: the export is as close as a different summation "
        "order allows."
    )


@section(310, "Quantization-aware training")
def qat_comparison(m: dict[str, Any], run_dir: Path) -> str | None:
    out = ""
    for c in _qat_candidates(m):
        meta = c["meta"]
        comp = meta["comparison"]
        rows = [_cells(label, comp["rows"][k]) for k, label in _ROWS if k in comp["rows"]]
        rows.append(_cells(f"QAT ({meta.get('label', '')})", comp["rows"]["qat"]))
        fz = meta.get("freezing", {})
        out += (
            f"<p><b>{html.escape(c['name'])}</b>: "
            f"{'kept' if c.get('accepted') else 'rejected'}: {html.escape(str(c.get('reason')))}. "
            f"BatchNorm {html.escape(str(fz.get('batchnorm')))}; ranges "
            f"{html.escape(str(fz.get('observers')))}. {html.escape(_export_text(meta))}</p>"
        )
        out += table(["model", "metric", "cosine", "p50 ms", "size", "ops in INT8"], rows)
        out += f"<p>{html.escape(_verdicts(comp.get('verdicts', {})))}</p>"
        for note in comp.get("notes", []):
            out += f"<p class='warn'>{html.escape(note)}</p>"
    return out or None
