"""Report sections for runtime auto: FP32 and the best INT8 on each runtime side by side, the
pick, and per-operator time on OpenVINO."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from . import section
from .html import fmt, table

__all__ = ["openvino_ops", "runtimes"]


def _figures(m: dict[str, Any], cand: str, runtime: str) -> dict[str, Any] | None:
    c = next((c for c in m.get("candidates", []) if c["name"] == cand), None)
    return ((c or {}).get("runtimes") or {}).get(runtime)


@section(12, "Runtimes side by side")
def runtimes(m: dict[str, Any], run_dir: Path) -> str | None:
    pick = m.get("runtime_pick")
    if not pick:
        return None
    base = _figures(m, "fp32-onnx", "onnxruntime") or {}
    base_p50 = (base.get("latency_ms") or {}).get("p50")
    rows = []
    for r in pick.get("side_by_side", []):
        f = _figures(m, r["candidate"], r["runtime"]) or {}
        p50 = (f.get("latency_ms") or {}).get("p50")
        picked = (r["candidate"], r["runtime"]) == (pick["candidate"], pick["runtime"])
        rows.append(
            [
                r["runtime"],
                r["kind"],
                html.escape(r["candidate"]) + (" (pick)" if picked else ""),
                fmt(p50),
                fmt(p50 / base_p50 if p50 and base_p50 else None) + "x",
                fmt((f.get("fidelity") or {}).get("cosine_mean"), 4),
                fmt(f.get("peak_rss_mb"), 1),
            ]
        )
    versions = ", ".join(f"{rt} {rec.get('version')}" for rt, rec in m.get("runtimes", {}).items())
    head = (
        f"<p>Every candidate measured on each runtime in one interleaved benchmark ({versions}). "
        f"Pick: <b>{html.escape(str(pick['candidate']))} on {html.escape(pick['runtime'])}</b>, "
        f"{html.escape(pick['rule'])}. Ratios against FP32 on ONNX Runtime.</p>"
    )
    return head + table(
        ["runtime", "", "candidate", "p50 ms", "vs FP32 ORT", "cosine", "peak RSS MB"], rows
    )


@section(41, "Per-operator time (OpenVINO performance counters)")
def openvino_ops(m: dict[str, Any], run_dir: Path) -> str | None:
    profiles = m.get("profiles_openvino")
    if not profiles:
        return None
    parts = []
    for name, prof in profiles.items():
        rows = [
            [html.escape(r["op_type"]), fmt(r["mean_ms_per_run"], 4), fmt(r["share"] * 100, 1)]
            for r in prof.get("by_op_type", [])
        ]
        kernels = ", ".join(f"{html.escape(k)} x{n}" for k, n in prof.get("exec_types", {}).items())
        parts.append(
            f"<h3>{html.escape(name)}</h3><p>kernels: {kernels}</p>"
            + table(["op type", "ms per run", "share %"], rows)
        )
    return "".join(parts)
