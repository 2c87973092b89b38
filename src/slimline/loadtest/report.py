"""Figures and HTML for load tests and sweeps: in the run report, or standalone next to a JSON.

Plots: latency percentiles against offered load (with the SLO and the knee), achieved against
offered rate, and the latency CDF at the knee (with the first step past it, for contrast).
The run report picks up ``loadtest*.json``, ``sweep*.json``, ``capacity*.json`` and
``tune-serving*.json`` files in the run directory.
"""

from __future__ import annotations

import html
import io
import json
from pathlib import Path
from typing import Any

from ..report import section
from ..report.plots import figure, plt, png_img
from .result import atomic_write

__all__ = ["cdf_plot", "load_plot", "rate_plot", "standalone_html", "write_standalone"]

_PCTS = (("p50", "p50"), ("p95", "p95"), ("p99", "p99"), ("p999", "p99.9"))


def _rates(doc: dict[str, Any]) -> list[float]:
    return [s["offered_rate"] for s in doc["steps"]]


def load_plot(doc: dict[str, Any], ax: Any = None) -> Any:
    """Latency percentiles against offered load."""
    fig, ax = figure() if ax is None else (None, ax)
    rates = _rates(doc)
    for key, label in _PCTS:
        ax.plot(rates, [s["latency_ms"][key] for s in doc["steps"]], marker="o", ms=3, label=label)
    ax.axhline(
        doc["slo_p99_ms"], color="red", ls="--", lw=1, label=f"SLO p99 {doc['slo_p99_ms']:g} ms"
    )
    if doc.get("knee"):
        ax.axvline(doc["knee"]["offered_rate"], color="gray", ls=":", lw=1, label="knee")
    ax.set(
        xlabel="offered load (requests/s)",
        ylabel="latency (ms)",
        yscale="log",
        title="Latency against offered load",
    )
    ax.legend(fontsize=7)
    return fig


def rate_plot(doc: dict[str, Any], ax: Any = None) -> Any:
    """Achieved against offered rate; the diagonal is perfect tracking."""
    fig, ax = figure() if ax is None else (None, ax)
    rates = _rates(doc)
    ax.plot(rates, [s["achieved_rate"] for s in doc["steps"]], marker="o", ms=3, label="achieved")
    ax.plot(rates, rates, color="gray", ls="--", lw=1, label="offered")
    ax.set(
        xlabel="offered (requests/s)",
        ylabel="achieved (requests/s)",
        title="Achieved against offered",
    )
    ax.legend(fontsize=7)
    return fig


def cdf_plot(doc: dict[str, Any], ax: Any = None) -> Any:
    """Latency CDF at the knee (and the first step above it), on a 'nines' axis."""
    import numpy as np

    fig, ax = figure() if ax is None else (None, ax)
    knee = (doc.get("knee") or {}).get("step")
    picks = [] if knee is None else [knee] + ([knee + 1] if knee + 1 < len(doc["steps"]) else [])
    for i in picks:
        step = doc["steps"][i]
        cdf = np.array(step.get("latency_cdf_ms") or [[0.0, 0.0]])
        q = np.clip(cdf[:, 0], 0, 1 - 1e-5)
        ax.plot(
            cdf[:, 1],
            -np.log10(1 - q),
            label=f"{step['offered_rate']:.0f} rps" + (" (knee)" if i == knee else ""),
        )
    ticks = [0, 1, 2, 3, 4]
    ax.set_yticks(ticks, ["0", "90%", "99%", "99.9%", "99.99%"])
    ax.set(xlabel="latency (ms)", ylabel="quantile", title="Latency CDF at the knee")
    if picks:
        ax.legend(fontsize=7)
    return fig


def _table(doc: dict[str, Any]) -> str:
    head = "<tr><th>offered</th><th>achieved</th><th>p50</th><th>p95</th><th>p99</th><th>p99.9</th><th>max</th><th>errors</th><th>queue</th><th>batch</th><th></th></tr>"
    rows = []
    for s in doc["steps"]:
        lat, srv = s["latency_ms"], s.get("server") or {}

        def f(v: Any, d: int = 1) -> str:
            return "-" if v is None else f"{v:.{d}f}"

        rows.append(
            f"<tr><td>{f(s['offered_rate'])}</td><td>{f(s['achieved_rate'])}</td>"
            + "".join(f"<td>{f(lat[k], 2)}</td>" for k in ("p50", "p95", "p99", "p999", "max"))
            + f"<td>{s['error_rate']:.2%}</td><td>{f(srv.get('queue_depth_mean'))}</td>"
            f"<td>{f(srv.get('batch_size_mean'), 2)}</td><td>{html.escape(s.get('why', ''))}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def sweep_html(doc: dict[str, Any]) -> str:
    knee = doc.get("knee")
    summary = (
        f"<p>Knee: <b>{knee['offered_rate']:.1f} requests/s</b> (p99 {knee['latency_ms']['p99']:.2f} ms "
        f"within the {doc['slo_p99_ms']:g} ms SLO)</p>"
        if knee
        else f"<p><b>No rate met the SLO</b> (p99 ≤ {doc['slo_p99_ms']:g} ms).</p>"
    )
    imgs = [
        png_img(load_plot(doc), "latency against offered load"),
        png_img(rate_plot(doc), "achieved against offered rate"),
    ]
    if knee:
        imgs.append(png_img(cdf_plot(doc), "latency CDF at the knee"))
    stop = html.escape(str(doc.get("stopped_because", "")))
    return summary + f"<p>Stopped: {stop}</p>" + "".join(imgs) + _table(doc)


def loadtest_html(doc: dict[str, Any]) -> str:
    lat, lag = doc["latency_ms"], doc["schedule_lag_ms"]
    cells = "".join(
        f"<td>{'-' if lat[k] is None else f'{lat[k]:.2f}'}</td>"
        for k in ("p50", "p95", "p99", "p999", "max")
    )
    offered = doc["offered_rate"]
    note = " <b>PARTIAL</b>" if doc.get("partial") else ""
    note += (
        ""
        if doc.get("valid", True)
        else f" <b>INVALID</b>: {html.escape(str(doc.get('invalid_reason')))}"
    )
    return (
        f"<p>{doc['mode']} loop{note}: offered {'-' if offered is None else f'{offered:.1f}'} rps, achieved "
        f"{doc['achieved_rate']:.1f} rps, {doc['requests']} requests, errors {doc['error_rate']:.2%}, "
        f"schedule lag p99 {lag['p99'] or 0:.2f} ms</p>"
        "<table><tr><th>p50</th><th>p95</th><th>p99</th><th>p99.9</th><th>max</th></tr>"
        f"<tr>{cells}</tr></table>"
    )


def result_html(doc: dict[str, Any]) -> str:
    kind = doc.get("kind")
    if kind == "sweep":
        return sweep_html(doc)
    if kind == "loadtest":
        return loadtest_html(doc)
    if kind == "capacity":
        return capacity_html(doc)
    if kind == "tune-serving":
        return tune_html(doc)
    return ""


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def capacity_html(doc: dict[str, Any]) -> str:
    return (
        f"<p>Peak {doc['peak_qps']:g} QPS at p99 ≤ {doc['slo_p99_ms']:g} ms with {doc['headroom']:.0%} "
        f"headroom: <b>{doc['machines']} machines</b> (capacity {doc['capacity_per_machine']:.1f} "
        f"requests/s each; {doc['load_at_peak']:.0%} loaded at peak; "
        f"{_num(doc['load_at_peak_minus_one'], '.0%')} "
        "with one machine down).</p>"
    )


def tune_html(doc: dict[str, Any]) -> str:
    best = doc.get("best")
    rows = "".join(
        f"<tr><td>{html.escape(c['variant'])}</td><td>{html.escape(json.dumps(c['serve']))}</td>"
        f"<td>{_num(c.get('knee_rate'), '.1f')}</td>"
        f"<td>{html.escape(c.get('note', ''))}</td></tr>"
        for c in doc.get("configs", [])
    )
    head = (
        (
            f"<p>Best within p99 ≤ {doc['slo_p99_ms']:g} ms: <b>{html.escape(best['variant'])}</b> "
            f"{html.escape(json.dumps(best['serve']))} at {best['knee_rate']:.1f} requests/s per machine"
            + (f" ({html.escape(doc['tie_note'])})" if doc.get("tie_note") else "")
            + "</p>"
        )
        if best
        else "<p><b>No configuration met the SLO.</b></p>"
    )
    return (
        head
        + f"<table><tr><th>variant</th><th>serve settings</th><th>knee (rps)</th><th></th></tr>{rows}</table>"
    )


def standalone_html(doc: dict[str, Any], title: str) -> str:
    style = "body{font-family:sans-serif;max-width:1000px;margin:auto}td,th{padding:2px 8px;text-align:right}"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>{result_html(doc)}</body></html>"
    )


def write_standalone(doc: dict[str, Any], json_path: Path) -> list[Path]:
    """``<stem>.html`` (and, for a sweep, ``<stem>.png`` with the three plots) beside the JSON."""
    out = [json_path.with_suffix(".html")]
    atomic_write(
        out[0], standalone_html(doc, f"slimline {doc.get('kind')}: {json_path.name}").encode()
    )
    if doc.get("kind") == "sweep" and doc["steps"]:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.2), dpi=100)
        load_plot(doc, axes[0])
        rate_plot(doc, axes[1])
        cdf_plot(doc, axes[2])
        fig.tight_layout()
        png = json_path.with_suffix(".png")
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        plt.close(fig)
        atomic_write(png, buf.getvalue())
        out.append(png)
    return out


@section(700, "Load test and capacity")
def _section(manifest: dict[str, Any], run_dir: Path) -> str | None:
    parts = []
    for pattern in ("loadtest*.json", "sweep*.json", "capacity*.json", "tune-serving*.json"):
        for path in sorted(run_dir.glob(pattern)):
            try:
                doc = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            body = result_html(doc) if isinstance(doc, dict) else ""
            if body:
                parts.append(f"<h3>{html.escape(path.name)}</h3>{body}")
    return "".join(parts) or None
