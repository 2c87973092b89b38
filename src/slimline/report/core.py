"""Core report sections: run facts, candidate summary, latency CDFs, per-op profile, weights."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np

from . import section
from .html import fmt, hardware_line, summary_rows, table
from .plots import figure, png_img


@section(0, "Run")
def run_facts(m: dict[str, Any], run_dir: Path) -> str:
    v = m.get("versions", {})
    rows: list[list[Any]] = [
        ["status", m.get("status")],
        ["task", f"{m['task']['name']} ({m['task']['source']})"],
        ["metric", m["task"]["metric_name"]],
        ["selected", m.get("selected")],
        ["target", f"{m['target']['runtime']}, {m['target']['threads']} threads"],
        ["budget", ", ".join(f"{k}={v}" for k, v in (m["recipe"].get("budget") or {}).items())],
        ["hardware", hardware_line(m)],
        ["versions", ", ".join(f"{k} {val}" for k, val in v.items() if val)],
        ["created", m.get("created")],
        ["wall time", f"{m.get('wall_seconds')} s"],
        ["model hash", m["hashes"].get("model")],
    ]
    out = table(["", ""], [[str(r[0]), fmt(r[1])] for r in rows])
    if m.get("failure"):
        out += f"<p class='warn'>Run failed: {html.escape(m['failure']['error'])}</p>"
    for w in m.get("warnings", []):
        out += f"<p class='warn'>warning: {html.escape(w)}</p>"
    return out


@section(5, "Inputs and data")
def inputs_and_data(m: dict[str, Any], run_dir: Path) -> str | None:
    """Where each input's batch axis is, and how the data was split (ONNX tasks)."""
    task = m.get("task", {})
    sig, notes = task.get("signature"), task.get("notes") or []
    if not sig and not notes:
        return None
    out = ""
    if sig:
        spec = task.get("inputs") or {}
        rows = [
            [
                html.escape(name),
                (spec.get(name) or {}).get("dtype"),
                html.escape(str((spec.get(name) or {}).get("shape"))),
                _axis_text(v["batch_axis"]),
            ]
            for name, v in sig["inputs"].items()
        ]
        rows += [
            [f"{html.escape(name)} (output)", "", "", _axis_text(v["batch_axis"])]
            for name, v in sig["outputs"].items()
        ]
        out += table(["name", "dtype", "model shape", "batch axis"], rows)
        if sig.get("max_batch") == 1:
            out += "<p>The model takes one row per call: rows are fed in turn.</p>"
        out += f"<p>Task metric on output <b>{html.escape(str(sig['primary_output']))}</b>.</p>"
    return out + "".join(f"<p>{html.escape(n)}</p>" for n in notes)


def _axis_text(axis: int | None) -> str:
    return "none (passed whole to every call)" if axis is None else str(axis)


@section(15, "Fidelity per output")
def fidelity_per_output(m: dict[str, Any], run_dir: Path) -> str | None:
    rows = [
        [
            html.escape(c["name"]),
            html.escape(name),
            f.get("cosine_mean"),
            f.get("cosine_min"),
            f.get("max_abs_err"),
        ]
        for c in m["candidates"]
        for name, f in ((c.get("fidelity") or {}).get("outputs") or {}).items()
    ]
    if len({r[1] for r in rows}) < 2:
        return None
    return table(["candidate", "output", "mean cosine", "min cosine", "max abs err"], rows) + (
        "<p>The budget's cosine applies to the worst output.</p>"
    )


@section(16, "Fidelity by output kind")
def fidelity_by_kind(m: dict[str, Any], run_dir: Path) -> str | None:
    """The outputs the recipe declared by kind: the agreement the budget judges, and the
    cosine beside it."""
    rows = [
        [
            html.escape(c["name"]),
            html.escape(name),
            f["kind"],
            f.get("agreement"),
            html.escape(_kind_figures(f)),
            f.get("cosine_mean"),
        ]
        for c in m["candidates"]
        for name, f in ((c.get("fidelity") or {}).get("declared") or {}).items()
    ]
    if not rows:
        return None
    budget = (m["recipe"].get("budget") or {}).get("min_agreement")
    return table(["candidate", "output", "kind", "agreement", "figures", "mean cosine"], rows) + (
        f"<p>The budget's min_agreement ({budget}) applies to the declared outputs, its "
        "min_cosine to the others; the cosine is shown for every output.</p>"
    )


def _kind_figures(f: dict[str, Any]) -> str:
    skip = {"kind", "agreement", "cosine_mean"}
    return ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in f.items()
        if k not in skip
    )


@section(10, "Candidates")
def candidates(m: dict[str, Any], run_dir: Path) -> str:
    headers, rows = summary_rows(m)
    cls = ["acc" if r[2] == "yes" else "rej" for r in rows]
    reasons = "".join(
        f"<li><b>{html.escape(c['name'])}</b> ({'kept' if c.get('accepted') else 'rejected'}): "
        f"{html.escape(c.get('reason') or '')}</li>"
        for c in m["candidates"]
    )
    return table(headers, rows, cls) + f"<ul>{reasons}</ul>"


@section(20, "Latency at batch 1 (CDF)")
def latency_cdf(m: dict[str, Any], run_dir: Path) -> str | None:
    series = [
        (c["name"], c["latency_samples_ms"]) for c in m["candidates"] if c.get("latency_samples_ms")
    ]
    if not series:
        return None
    fig, ax = figure()
    for name, samples in series:
        s = np.sort(np.asarray(samples))
        ax.plot(s, np.arange(1, len(s) + 1) / len(s), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log)")
    ax.set_ylabel("fraction of runs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png_img(fig, "latency CDF per candidate")


@section(30, "Throughput by batch size")
def throughput(m: dict[str, Any], run_dir: Path) -> str | None:
    rows = [
        (c["name"], {**c.get("throughput_not_applicable", {}), **c["throughput"]})
        for c in m["candidates"]
        if c.get("throughput")
    ]
    if not rows:
        return None
    sizes = sorted({int(b) for _, tp in rows for b in tp})
    out = table(
        ["candidate", *[f"batch {b} (items/s)" for b in sizes]],
        [[n, *[_na(tp.get(str(b))) for b in sizes]] for n, tp in rows],
    )
    reasons = {
        r for c in m["candidates"] for r in (c.get("throughput_not_applicable") or {}).values()
    }
    return out + "".join(f"<p>n/a: {html.escape(r)}</p>" for r in sorted(reasons))


def _na(value: Any) -> Any:
    return "n/a" if isinstance(value, str) else value


@section(40, "Per-operator time (ONNX Runtime profiler)")
def op_profile(m: dict[str, Any], run_dir: Path) -> str | None:
    profiles = m.get("profiles") or {}
    if not profiles:
        return None
    out = []
    for name, prof in profiles.items():
        ops = prof.get("by_op_type", [])[:15]
        fig, ax = figure(7, 0.3 * len(ops) + 1)
        ax.barh([o["op_type"] for o in ops][::-1], [o["share"] * 100 for o in ops][::-1])
        ax.set_xlabel("share of operator time (%)")
        ax.set_title(name)
        out.append(f"<h3>{html.escape(name)}</h3>" + png_img(fig, f"op time {name}"))
        out.append(
            table(
                ["op type", "total ms", "ms/run", "share", "nodes"],
                [
                    [
                        o["op_type"],
                        o["total_ms"],
                        o["mean_ms_per_run"],
                        f"{o['share']:.1%}",
                        o["count"],
                    ]
                    for o in ops
                ],
            )
        )
        nodes = prof.get("by_node", [])[:15]
        out.append(
            table(
                ["node", "op type", "ms/run", "share"],
                [
                    [n["node"], n["op_type"], n["mean_ms_per_run"], f"{n['share']:.1%}"]
                    for n in nodes
                ],
            )
        )
    return "".join(out)


@section(50, "Weight distributions (FP32)")
def weights(m: dict[str, Any], run_dir: Path) -> str | None:
    dist = m.get("weight_distributions")
    if not dist:
        return None
    layers = dist.get("layers", dist) if isinstance(dist, dict) else dist
    if isinstance(layers, dict):
        layers = [{"name": k, **v} for k, v in layers.items()]
    layers = sorted(layers, key=lambda r: -float(r.get("outlier_share", 0)))[:20]
    rows = [
        [
            r.get("name"),
            r.get("min"),
            r.get("max"),
            r.get("std"),
            r.get("absmax_over_std"),
            f"{float(r.get('outlier_share', 0)):.4%}",
        ]
        for r in layers
    ]
    rec = dist.get("recommendation") if isinstance(dist, dict) else None
    note = f"<p>Calibration recommendation: <b>{html.escape(str(rec))}</b></p>" if rec else ""
    return note + table(["tensor", "min", "max", "std", "absmax/std", "beyond 6 std"], rows)
