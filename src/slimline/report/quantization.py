"""Report sections of the quantize step: the search, the layer-wise error, the distributions."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from ..records import QuantizeRecord, TrialSummary, quantize_record
from . import section
from .html import fmt, table
from .plots import figure, png_img

__all__ = ["distributions", "layerwise", "search"]

_BARS = 30


def _quantized(m: dict[str, Any]) -> dict[str, Any] | None:
    """The quantize step's own candidate (the one it picked), if the run has one. A step that
    failed as a whole picked none: its reason is in the candidate list."""
    cands = [
        c
        for c in m.get("candidates", [])
        if c.get("step") == "quantize"
        and not c.get("alternative")
        and "search" in (c.get("meta") or {})
    ]
    return cands[-1] if cands and cands[-1].get("meta") else None


def _record(m: dict[str, Any]) -> QuantizeRecord | None:
    c = _quantized(m)
    return quantize_record(c["meta"]) if c is not None else None


def _e(x: Any) -> str:
    return html.escape(str(x))


@section(300, "Quantization (INT8)")
def search(m: dict[str, Any], run_dir: Path) -> str | None:
    c = _quantized(m)
    if c is None:
        return None
    meta = quantize_record(c["meta"])
    out = f"<p>Chosen: <b>{_e(meta.get('label'))}</b>, {_e(meta.get('fallback_report'))}. "
    out += f"Pipeline decision: {'kept' if c.get('accepted') else 'rejected'}: {_e(c.get('reason'))}</p>"
    if meta.get("no_candidate_met_budget"):
        out += f"<p class='warn'>{_e(meta['no_candidate_met_budget'])}</p>"
    rows = [
        [
            _e(t["label"]) + (f" + {t['float_nodes']} float" if t.get("float_nodes") else ""),
            _e(t["kernels"]),
            t.get("ratio_vs_fp32"),
            (t.get("fidelity") or {}).get("cosine_mean"),
            t.get("metric"),
            _in_budget(t),
        ]
        for t in meta.get("search", {}).get("candidates", [])
    ]
    out += table(
        ["candidate", "runs INT8", "latency / FP32", "cosine", "metric", "in budget"], rows
    )
    out += _alternatives(m)
    out += _facts(meta)
    out += _precision(meta)
    return out


def _in_budget(t: TrialSummary) -> str:
    if t.get("slow_at_any_range"):  # set aside by the speed check: never evaluated
        return "not evaluated (slower than FP32 at any ranges)"
    return "yes" if t.get("budget_ok") else "no"


def _alternatives(m: dict[str, Any]) -> str:
    alts = [
        a for a in m.get("candidates", []) if a.get("alternative") and a.get("step") == "quantize"
    ]
    if not alts:
        return ""
    return (
        "<ul>"
        + "".join(f"<li><b>{_e(a['name'])}</b>: {_e(a.get('reason'))}</li>" for a in alts)
        + "</ul>"
    )


def _facts(meta: QuantizeRecord) -> str:
    cal, rep = meta.get("calibration", {}), meta.get("representativeness", {})
    rows = [
        ["graph preparation", _e("; ".join(meta.get("prepared", {}).get("notes", [])) or "-")],
        [
            "calibration",
            _e(
                f"{cal.get('samples')} samples in chunks of {cal.get('chunk_rows')}, "
                f"{cal.get('wall_s')} s, peak RSS {cal.get('peak_rss_mb')} MB"
                + (f" ({cal['note']})" if cal.get("note") else "")
            ),
        ],
        *(
            [["speed check (static candidates timed first)", _e(check["result"])]]
            if (check := meta.get("search", {}).get("speed_check"))
            else []
        ),
        ["step time", _e(f"{meta.get('step_wall_s')} s: {meta.get('timings_s')}")],
        [
            "calibration vs evaluation ranges",
            _e(
                f"{len(rep.get('flagged', []))} of "
                f"{rep.get('tensors_checked', 0)} tensors often exceeded"
            ),
        ],
    ]
    out = table(["", ""], rows)
    used = set(rep.get("flagged_in_chosen", []))
    for f in rep.get("flagged", [])[:10]:
        out += (
            f"<p class='{'warn' if f['tensor'] in used else 'note'}'>evaluation inputs exceed the "
            f"calibrated range of {_e(f['tensor'])} in {f['exceed_share']:.0%} of samples (by up "
            f"to {f['max_overshoot']:.2f} range widths)"
            f"{'' if f['tensor'] in used else '; the chosen model does not use this range'}</p>"
        )
    if rep.get("note"):
        out += f"<p>{_e(rep['note'])}</p>"
    for n in meta.get("notes", []):
        out += f"<p class='warn'>{_e(n)}</p>"
    return out


def _precision(meta: QuantizeRecord) -> str:
    pm = meta.get("precision_map", {})
    floats = [(n, d["rule"]) for n, d in pm.get("nodes", {}).items() if d["precision"] == "float"]
    out = f"<p>Precision map: {pm.get('int8', 0)} INT8, {pm.get('float', 0)} float.</p>"
    if floats:
        out += table(["node kept in float", "why"], [[_e(n), _e(r)] for n, r in floats])
    trace = meta.get("search", {}).get("mixed_precision") or []
    steps = [t for t in trace if "impact" not in t]
    if steps:
        out += (
            "<p>Mixed precision:</p><ul>"
            + "".join(f"<li>{_e(_step(t))}</li>" for t in steps)
            + "</ul>"
        )
    for t in trace:
        if "impact" in t:
            out += _impact(t)
    return out


def _impact(t: dict[str, Any]) -> str:
    """The measured output gain of each node kept alone in float, in the order tried."""
    rows = [
        [_e(r["node"]), fmt(r["cosine"], 5), f"{r['gain']:+.5f}", fmt(r["cost"], 3)]
        for r in t["impact"]
    ]
    return (
        f"<p>Output impact (what the budget judges, with the node alone kept in float: the mean "
        f"cosine to the FP32 reference, or with outputs declared by kind the smaller margin over "
        f"the budget; against {fmt(t.get('base_score', t.get('base_cosine')), 5)} with none; "
        f"nodes are tried by gain per cost):</p>"
        + table(["node kept in float", "cosine", "gain", "cost (share of the largest)"], rows)
    )


def _step(t: dict[str, Any]) -> str:
    if "float_nodes" in t:
        fid = t.get("fidelity") or {}
        return f"{t['float_nodes']} nodes in float: {'meets' if t['ok'] else 'misses'} the budget (cosine {fmt(fid.get('cosine_mean'), 4)}); {t['reason']}"
    return "; ".join(f"{k}: {v}" for k, v in t.items() if k != "float_nodes_list")


@section(310, "Layer-wise quantization error")
def layerwise(m: dict[str, Any], run_dir: Path) -> str | None:
    rec = _record(m)
    rows = rec.get("layerwise") if rec is not None else None
    if rec is None or not rows:
        return None
    out = f"<p>{_e(rec.get('layerwise_statement'))}</p>"
    shown = [r for r in rows if r.get("local_sqnr_db") is not None][:_BARS]
    if shown:
        fig, ax = figure(7.5, max(2.5, 0.22 * len(shown) + 1))
        names = [f"{r['node'][-40:]} ({r['op_type']})" for r in shown][::-1]
        ax.barh(names, [r["local_sqnr_db"] for r in shown][::-1], label="own quantization")
        ax.plot([r["sqnr_db"] or 0 for r in shown][::-1], names, "k.", label="output (accumulated)")
        ax.set_xlabel("SQNR vs FP32 (dB), worst first")
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=7)
        out += png_img(fig, "layer-wise SQNR")
    out += table(
        ["node", "op", "own SQNR dB", "output SQNR dB", "output cosine"],
        [
            [
                _e(r["node"]),
                _e(r["op_type"]),
                r.get("local_sqnr_db"),
                r.get("sqnr_db"),
                r.get("cosine"),
            ]
            for r in rows
        ],
    )
    return out


@section(320, "Activation and weight distributions")
def distributions(m: dict[str, Any], run_dir: Path) -> str | None:
    rec = _record(m)
    dist = rec.get("distributions") if rec is not None else None
    if not dist:
        return None
    rec = dist.get("recommendation", {})
    out = f"<p>Recommended calibration: <b>{_e(rec.get('method'))}</b>: {_e(rec.get('reason'))}</p>"
    hists = dist.get("histograms", {})
    if hists:
        from matplotlib.ticker import NullLocator

        n = len(hists)
        fig, _ = figure(7.5, 1.8 * ((n + 1) // 2))
        fig.clf()
        for i, (name, (counts, edges)) in enumerate(hists.items()):
            ax = fig.add_subplot((n + 1) // 2, 2, i + 1)
            ax.stairs(counts, edges, fill=True)
            ax.set_yscale("log")
            # no unlabelled minor ticks between decades: they cost 60% of the figure's time
            ax.yaxis.set_minor_locator(NullLocator())
            ax.set_title(name[-50:], fontsize=7)
            ax.tick_params(labelsize=6)
        out += png_img(fig, "histograms of the activations with the most outliers")
    cols = ["tensor", "min", "max", "p99", "max |x| / std", "share beyond 6 std"]
    for title, key in (
        ("Activations (most outliers first)", "activations_top"),
        ("Weights", "weights_top"),
    ):
        stats = dist.get(key, {})
        if stats:
            out += f"<p>{title}</p>" + table(
                cols,
                [
                    [
                        _e(k),
                        s.get("min"),
                        s.get("max"),
                        s.get("p99"),
                        s.get("absmax_over_std"),
                        s.get("outlier_share"),
                    ]
                    for k, s in stats.items()
                ],
            )
    return out
