"""Report section of a memory budget: each measured runtime setting's peak RSS against its
latency, the budget, and the setting chosen."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from . import section
from .html import fmt, table
from .plots import figure, png_img

__all__ = ["memory_profile", "tradeoff_plot"]


def tradeoff_plot(profile: dict[str, Any]) -> str:
    """Peak RSS (x) against p50 and p99 at the smallest batch (y), one point pair per setting."""
    rows = [r for r in profile.get("rows", []) if "error" not in r]
    fig, ax = figure()
    ax.scatter([r["peak_rss_mb"] for r in rows], [r["p50_ms"] for r in rows], label="p50")
    ax.scatter([r["peak_rss_mb"] for r in rows], [r["p99_ms"] for r in rows], marker="x",
               label="p99")  # fmt: skip
    chosen, default = profile.get("chosen"), profile.get("default")
    if default:
        ax.scatter([default["peak_rss_mb"]], [default["p50_ms"]], s=120, facecolors="none",
                   edgecolors="gray", label="defaults (p50)")  # fmt: skip
    if chosen:
        ax.scatter([chosen["peak_rss_mb"]], [chosen["p50_ms"]], s=160, facecolors="none",
                   edgecolors="red", label="chosen (p50)")  # fmt: skip
    ax.axvline(profile["budget_mb"], color="red", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("peak RSS (MB, VmHWM of a fresh process)")
    ax.set_ylabel(f"latency at batch {min(profile.get('batch_sizes') or [1])} (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    return png_img(fig, "peak RSS vs latency per runtime setting")


@section(60, "Memory profile")
def memory_profile(m: dict[str, Any], run_dir: Path) -> str | None:
    profile = m.get("memory_profile")
    if not profile:
        return None
    chosen = profile.get("chosen")
    out = (
        f"<p>Budget {fmt(profile['budget_mb'], 1)} MB peak RSS for candidate "
        f"<b>{html.escape(str(profile.get('candidate')))}</b>, measured at batch sizes "
        f"{profile.get('batch_sizes')}"
        f"{' with varying input shapes' if profile.get('varying_shapes') else ''}. "
    )
    out += (
        f"Chosen: <b>{html.escape(chosen['label'])}</b>.</p>"
        if chosen
        else "<p class='warn'>No setting fits the budget.</p>"
    )
    rows = sorted(
        (r for r in profile.get("rows", []) if "error" not in r), key=lambda r: r["peak_rss_mb"]
    )
    out += tradeoff_plot(profile)
    out += table(
        ["setting", "peak RSS MB", "above imports MB", "p50 ms", "p99 ms"],
        [
            [
                html.escape(r["label"]),
                r["peak_rss_mb"],
                r.get("model_rss_mb"),
                r["p50_ms"],
                r["p99_ms"],
            ]
            for r in rows
        ],
        ["acc" if chosen and r["label"] == chosen["label"] else "" for r in rows],
    )
    failed = [r for r in profile.get("rows", []) if "error" in r]
    if failed:
        out += (
            "<ul>"
            + "".join(
                f"<li>{html.escape(r['label'])}: {html.escape(r['error'])}</li>" for r in failed
            )
            + "</ul>"
        )
    return out
