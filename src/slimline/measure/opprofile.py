"""Per-operator time from the ONNX Runtime profiler, aggregated by op type and by node.

The session runs with profiling on (``SessionOptions.enable_profiling``) and the same thread
settings as every other measurement (intra-op = threads, inter-op = 1, sequential). After
``warmup`` runs (traced but not counted), ``runs`` runs are recorded (fewer for a slow model:
about :data:`PROFILE_SECONDS` of them, at least :data:`PROFILE_MIN_RUNS`); the JSON trace that
``end_profiling()`` writes is parsed and deleted. Kernel time is the ``dur`` of each ``Node``
event named ``<node>_kernel_time``; only events after the warm-up runs' ``model_run`` events count.
Shares are of the summed kernel time, so they sum to 1; the time outside kernels (the session's
own work between them, the profiler's bookkeeping included) is ``overhead_share`` of the wall
time of the recorded runs.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..task import Inputs
from ..tensors import drop_frozen
from .runners import ort_session, runs_to_fill, session_frozen

__all__ = ["aggregate", "kernel_events", "profile_ops"]

_KERNEL_SUFFIX = "_kernel_time"


def profile_ops(
    onnx_path: Path | str,
    inputs: Inputs,
    threads: int,
    runs: int = 50,
    top: int = 15,
    warmup: int = 5,
    level: str = "all",
) -> dict[str, Any]:
    """Run the model ``runs`` times on ``inputs`` under the profiler and aggregate kernel time.

    Returns ``{"runs", "threads", "total_ms_per_run", "overhead_share", "by_op_type": [...],
    "by_node": [...]}``; each list holds the ``top`` entries by total time, with ``total_ms``,
    ``mean_ms_per_run``, ``share`` and ``count`` (kernel calls). Node names and op types are the
    ones ONNX Runtime executes after its graph optimizations at ``level`` (``"disable"``,
    ``"basic"``, ``"extended"`` or ``"all"``): fused nodes show under their fused names.
    """
    if runs < 1 or level not in _LEVELS:
        raise ValueError(f"runs must be >= 1 and level one of {sorted(_LEVELS)}")
    with tempfile.TemporaryDirectory(prefix="slimline-prof-") as tmp:
        sess = _session(Path(onnx_path), threads, Path(tmp) / "ort", level)
        takes = {i.name for i in sess.get_inputs()}
        inputs = drop_frozen(inputs, takes, session_frozen(sess), Path(onnx_path).name)
        feed = {k: np.ascontiguousarray(v) for k, v in inputs.items()}
        runs = profile_runs(lambda: sess.run(None, feed), warmup, runs)
        for _ in range(runs):
            sess.run(None, feed)
        trace = Path(sess.end_profiling())
        try:
            events = json.loads(trace.read_text())
        finally:
            trace.unlink(missing_ok=True)
    kernels, wall_us = kernel_events(events, skip_runs=warmup)
    result = aggregate(kernels, runs, top)
    total_us = sum(k["dur"] for k in kernels)
    result["threads"] = threads
    result["overhead_share"] = max(0.0, 1.0 - total_us / wall_us) if wall_us > 0 else 0.0
    return result


_LEVELS = {"disable": 0, "basic": 1, "extended": 2, "all": 99}
# a profile records about this long of runs, at least PROFILE_MIN_RUNS: where each op's time
# goes is a share, stable over a few runs of a slow model (an 800 x 608 detector's 50 runs on
# two runtimes took 22 s of its run on an AVX2-only CPU)
PROFILE_SECONDS = 3.0
PROFILE_MIN_RUNS = 10


def profile_runs(run: Callable[[], Any], warmup: int, runs: int) -> int:
    """Run ``run`` ``warmup`` times (the last one timed); the runs to record: ``runs``, or as
    many as fill :data:`PROFILE_SECONDS` at that speed, not under :data:`PROFILE_MIN_RUNS`."""
    took = 0.0
    for _ in range(warmup):
        t0 = time.perf_counter()
        run()
        took = time.perf_counter() - t0
    return runs_to_fill(took, PROFILE_SECONDS, PROFILE_MIN_RUNS, runs)


def _session(path: Path, threads: int, prefix: Path, level: str) -> Any:
    return ort_session(path, threads, profile=prefix, level=level)


def kernel_events(
    events: list[dict[str, Any]], skip_runs: int
) -> tuple[list[dict[str, Any]], float]:
    """Kernel events ``{"node", "op_type", "dur"}`` (dur in us) after the first ``skip_runs``
    ``model_run`` events, and the summed wall time (us) of the runs kept."""
    model_runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
        key=lambda e: e["ts"],
    )
    kept = model_runs[skip_runs:]
    start = kept[0]["ts"] if kept else float("inf")
    kernels = [
        {
            "node": e["name"][: -len(_KERNEL_SUFFIX)],
            "op_type": e.get("args", {}).get("op_name", "?"),
            "dur": float(e["dur"]),
        }
        for e in events
        if e.get("cat") == "Node"
        and str(e.get("name", "")).endswith(_KERNEL_SUFFIX)
        and e.get("ts", 0) >= start
    ]
    return kernels, float(sum(e["dur"] for e in kept))


def aggregate(kernels: list[dict[str, Any]], runs: int, top: int) -> dict[str, Any]:
    """Totals by op type and by node, sorted by time, the ``top`` of each, with shares."""
    total_us = sum(k["dur"] for k in kernels)
    by_type: dict[str, list[float]] = defaultdict(list)
    by_node: dict[tuple[str, str], list[float]] = defaultdict(list)
    for k in kernels:
        by_type[k["op_type"]].append(k["dur"])
        by_node[(k["node"], k["op_type"])].append(k["dur"])
    types = [_row({"op_type": t}, d, runs, total_us) for t, d in by_type.items()]
    nodes = [_row({"node": n, "op_type": t}, d, runs, total_us) for (n, t), d in by_node.items()]
    return {
        "runs": runs,
        "total_ms_per_run": round(total_us / 1000 / runs, 6),
        "op_types": len(types),
        "nodes": len(nodes),
        "by_op_type": sorted(types, key=lambda r: -r["total_ms"])[:top],
        "by_node": sorted(nodes, key=lambda r: -r["total_ms"])[:top],
    }


def _row(key: dict[str, str], durs: list[float], runs: int, total_us: float) -> dict[str, Any]:
    s = sum(durs)
    return {
        **key,
        "total_ms": round(s / 1000, 6),
        "mean_ms_per_run": round(s / 1000 / runs, 6),
        "share": s / total_us if total_us > 0 else 0.0,
        "count": len(durs),
    }
