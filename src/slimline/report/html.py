"""Build ``report.html`` (self-contained) and the terminal summary from a run's manifest."""

from __future__ import annotations

import html
import statistics
from pathlib import Path
from typing import Any

from ..record import atomic_write_text, load_manifest
from . import sections

__all__ = ["fmt", "summary_rows", "summary_table", "table", "write_report"]

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
.rej{color:#999}.acc{font-weight:600}.warn{color:#a60}code{background:#f6f6f6;padding:1px 4px}
h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:2em}
"""


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return html.escape(str(x))


def table(headers: list[str], rows: list[list[Any]], row_class: list[str] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for i, r in enumerate(rows):
        cls = f' class="{row_class[i]}"' if row_class else ""
        body.append(
            f"<tr{cls}>"
            + "".join(f"<td>{c if isinstance(c, str) else fmt(c)}</td>" for c in r)
            + "</tr>"
        )
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _base_latency(manifest: dict[str, Any]) -> dict[str, Any] | None:
    for c in manifest["candidates"]:
        if c["name"] == "fp32-onnx" and c.get("latency_ms"):
            return dict(c["latency_ms"])
    return None


def ratio_to_base(lat: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    """A candidate's latency as a multiple of FP32 ONNX Runtime's.

    All candidates of a run's final benchmark are timed in the same interleaved rounds, so the
    median of the per-round ratios is used: a round compares two measurements seconds apart,
    while the ratio of the two medians can pair a fast-mode round of one with a slow-mode round
    of the other on a drifting machine. Manifests without per-round figures fall back to that
    ratio of medians."""
    if not base or not lat.get("p50"):
        return None
    b, c = base.get("per_round_p50"), lat.get("per_round_p50")
    if b and c and len(b) == len(c):
        return float(statistics.median(ci / bi for ci, bi in zip(c, b, strict=True)))
    return float(lat["p50"] / base["p50"])


def summary_rows(manifest: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = [
        "candidate",
        "step",
        "kept",
        "p50 ms",
        "p50 band",
        "p99 ms",
        "x fp32-onnx",
        "CPU ms/run",
        "thr/s (max batch)",
        "RSS MB",
        "size MB",
        "metric",
        "cosine",
        "top-1 agr.",
    ]
    base = _base_latency(manifest)
    rows = []
    for c in manifest["candidates"]:
        lat = c.get("latency_ms") or {}
        tp = c.get("throughput") or {}
        fid = c.get("fidelity") or {}
        band = lat.get("band")
        ratio = ratio_to_base(lat, base)
        size = c.get("size_bytes")
        rows.append(
            [
                c["name"],
                c["step"],
                "yes" if c.get("accepted") else "no",
                lat.get("p50"),
                f"{band[0]:.3f}-{band[1]:.3f}" if band else "-",
                lat.get("p99"),
                f"{ratio:.2f}x" if ratio else "-",
                (c.get("cpu_ms") or {}).get("p50"),
                tp[max(tp, key=int)] if tp else None,
                c.get("peak_rss_mb"),
                size / 1e6 if size else None,
                (c.get("metric") or {}).get("value"),
                fid.get("cosine_mean"),
                fid.get("top1_agreement"),
            ]
        )
    if any("agreement" in (c.get("fidelity") or {}) for c in manifest["candidates"]):
        # outputs declared by kind: the budget's agreement, beside the cosine
        headers.append("agreement")
        for r, c in zip(rows, manifest["candidates"], strict=True):
            r.append((c.get("fidelity") or {}).get("agreement"))
    return headers, rows


def hardware_line(manifest: dict[str, Any]) -> str:
    """The target the figures hold for: CPU, its INT8 kind and features, cores and threads."""
    hw = manifest.get("hardware") or {}
    int8 = hw.get("int8")
    if isinstance(int8, dict):
        present = [k for k, v in int8.items() if k != "kind" and v is True]
        kind = f"{int8.get('kind')} ({', '.join(present) or 'no INT8 extensions'})"
        text = int8.get("proc_cpuinfo")
        if isinstance(text, dict):
            kind += f" as CPUID shows it; /proc/cpuinfo claims {text.get('kind')}"
    else:
        kind = f"INT8 features not recorded (flags: {', '.join(hw.get('flags') or []) or '-'})"
    threads = (manifest.get("target") or {}).get("threads")
    return f"{hw.get('cpu')}, {kind}, {hw.get('cores')} cores, {threads} threads"


def summary_table(manifest: dict[str, Any]) -> str:
    """The candidate summary as fixed-width text, for the terminal."""
    headers, rows = summary_rows(manifest)
    cells = [headers] + [[fmt(v, 3) if not isinstance(v, str) else v for v in r] for r in rows]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            str(v).rjust(w) if i else str(v).ljust(w)
            for i, (v, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    sel = manifest.get("selected")
    lines.append(f"selected: {sel}   status: {manifest.get('status')}")
    lines.append(f"measured on: {hardware_line(manifest)}")
    return "\n".join(lines)


def write_report(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    manifest = load_manifest(run_dir)
    parts = [f"<h1>slimline report: {html.escape(manifest['recipe']['name'])}</h1>"]
    for _, title, fn in sections():
        body = fn(manifest, run_dir)
        if body:
            parts.append(f"<h2>{html.escape(title)}</h2>\n{body}")
    doc = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>slimline report</title>"
        f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>"
    )
    out = run_dir / "report.html"
    atomic_write_text(out, doc)
    return out
