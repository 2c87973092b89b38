"""The quantize step's search before and after issue 27's cuts (subset screening, mixed
precision stopped when the float share cannot reach the budget), from two runs of one recipe:
one with the code before (``git archive BASE src``), one with the current code. Writes a
section into a results file.

    git archive 5eedcdb src | tar -x -C /tmp/ab/old
    SLIMLINE_CACHE=/tmp/ab/cache-old PYTHONPATH=/tmp/ab/old/src .venv/bin/python -m slimline.cli \\
        optimize RECIPE --out /tmp/ab/run-old           # and the same with src/ -> /tmp/ab/run-new
    .venv/bin/python bench/quantize_search_ab.py /tmp/ab/run-old /tmp/ab/run-new \\
        --out bench/RESULTS-fidelity-kinds.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench_out import put_section, reproduce_command
from slimline.record import atomic_write_text


def quantize_meta(run: Path) -> dict[str, Any]:
    m = json.loads((run / "manifest.json").read_text())
    q = next(c for c in m["candidates"] if c["name"] == "quantize")
    meta = q.get("meta") or {}
    search = meta.get("search") or {}
    probes = [t for t in search.get("mixed_precision") or [] if "float_nodes" in t]
    impact = next((t for t in search.get("mixed_precision") or [] if "impact" in t), None)
    return {
        "recipe": m["recipe"]["name"],
        "hardware": (m.get("hardware") or {}).get("cpu"),
        "step_wall_s": meta.get("step_wall_s"),
        "timings_s": meta.get("timings_s"),
        "probes": len(probes),
        "impact_nodes_measured": len(impact["impact"]) if impact else 0,
        "stopped": search.get("stopped", "(not recorded before issue 27)"),
        "accepted": q.get("accepted"),
        "reason": q.get("reason"),
    }


def section(old: dict[str, Any], new: dict[str, Any], cmd: str) -> str:
    lines = [
        f"### The quantize search before and after issue 27 ({new['recipe']})",
        "",
        f"Two `slimline optimize` runs of the same recipe, one after the other on {new['hardware']} "
        "(a loaded 2-core machine: wall times are indicative), cold caches.",
        "",
        "| code | quantize step s | mixed-precision probes | nodes measured for output impact | "
        "stopped | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in (("before", old), ("after", new)):
        verdict = "kept" if r["accepted"] else "rejected"
        lines.append(
            f"| {name} | {r['step_wall_s']} | {r['probes']} | {r['impact_nodes_measured']} | "
            f"{r['stopped']} | {verdict}: {str(r['reason'])[:160]} |"
        )
    lines += ["", f"Time by phase before: {old['timings_s']}", "", f"after: {new['timings_s']}"]
    lines += ["", "Reproduce (after the two runs):", "", f"    {cmd}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    body = section(
        quantize_meta(args.old),
        quantize_meta(args.new),
        reproduce_command("quantize_search_ab.py", argv),
    )
    print(body)
    if args.out is not None:
        text = args.out.read_text() if args.out.exists() else ""
        atomic_write_text(args.out, put_section(text, "quantize-search-ab", body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
