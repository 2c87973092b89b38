"""A memory-bounded runtime profile, chosen by measurement.

On a device the binding constraint is memory: ONNX Runtime's CPU arena, memory patterns and
thread pools can hold several times the model's size. :func:`measure_settings` runs each
:class:`~slimline.edge.setting.MemorySetting` in a fresh subprocess on the batch sizes to be
served (and, for inputs with free non-batch dimensions, on shorter shapes too, so arena growth
under varying shapes is part of the peak), and records the process's peak RSS (``VmHWM``) with
the latency p50/p99 at the smallest batch. :func:`choose` picks the fastest setting whose peak
stays under the budget; when none does, :class:`MemoryBudgetError` names the smallest peak
measured and the setting behind it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MemoryBudgetError, SlimlineError
from ..tensors import FROZEN_KEY, drop_frozen, frozen_from_json
from .setting import MemorySetting, session_path

__all__ = [
    "MemoryBudgetError",
    "choose",
    "chosen_setting",
    "measure_settings",
    "memory_profile",
    "settings_grid",
    "shape_variants",
]

Inputs = dict[str, np.ndarray]
Row = dict[str, Any]


def settings_grid(threads: int, varying_shapes: bool) -> list[MemorySetting]:
    """Every combination of the options that decide memory; ONNX Runtime's defaults first.

    Thread counts are ``threads`` and 1; graph optimization ``all`` (ONNX Runtime's default,
    with layout transformations) and ``basic``; arena shrinkage is tried (with the arena on)
    only when input shapes vary, the case it exists for."""
    counts = sorted({threads, 1}, reverse=True)
    grid = [
        MemorySetting(
            arena=arena, mem_pattern=pattern, execution_mode=mode, threads=n, graph_level=level
        )
        for level in ("all", "basic")
        for n in counts
        for arena in (True, False)
        for pattern in (True, False)
        for mode in ("sequential", "parallel")
    ]
    # memory-mapped weights, with the options that matter beside them (patterns on)
    grid += [
        s.model_copy(update={"mmap_weights": True})
        for s in list(grid)
        if s.mem_pattern and s.execution_mode == "sequential"
    ]
    if varying_shapes:
        grid += [s.model_copy(update={"arena_shrinkage": True}) for s in list(grid) if s.arena]
    return grid


# -- workload -----------------------------------------------------------------------------------
def _varying_dims(model: Path) -> set[str]:
    """Symbolic dimension names of the model's inputs that are not a batch axis (axis 0)."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    initializers = {i.name for i in proto.graph.initializer}
    batch: set[str] = set()
    named: set[str] = set()
    for inp in proto.graph.input:
        if inp.name in initializers:
            continue
        for axis, dim in enumerate(inp.type.tensor_type.shape.dim):
            if dim.dim_param:
                (batch if axis == 0 else named).add(dim.dim_param)
    return named - batch


def _dim_params(model: Path) -> dict[str, list[str]]:
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    return {i.name: [d.dim_param for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}


def shape_variants(inputs: Inputs, dims: dict[str, list[str]], varying: set[str]) -> list[Inputs]:
    """``inputs`` cut to a quarter, a half and all of their length along every ``varying``
    dimension, shortest first (so an arena that keeps what it grew shows it)."""
    lengths = {
        inputs[name].shape[axis]
        for name, params in dims.items()
        if name in inputs
        for axis, p in enumerate(params)
        if p in varying and axis < inputs[name].ndim
    }
    if len(lengths) != 1:  # no varying dimension, or inputs that disagree on its length
        return [inputs]
    full = lengths.pop()
    steps = sorted({max(1, full // 4), max(1, full // 2), full})
    out = []
    for length in steps:
        cut = {}
        for name, arr in inputs.items():
            index = tuple(
                slice(0, length) if p in varying else slice(None)
                for p in (dims.get(name) or [""] * arr.ndim)[: arr.ndim]
            )
            cut[name] = np.ascontiguousarray(arr[index])
        out.append(cut)
    return out


def workload(
    model: Path, sample: Callable[[int], Inputs], batch_sizes: Sequence[int]
) -> tuple[list[Inputs], int, bool]:
    """The inputs a setting is measured on (batch sizes in order, shape variants of each), the
    index of the timed call (the smallest batch at its full shape) and whether shapes vary."""
    varying = _varying_dims(model)
    dims = _dim_params(model)
    calls: list[Inputs] = []
    timed = 0
    for b in sorted(set(batch_sizes)):
        variants = shape_variants(sample(b), dims, varying)
        if not calls:
            timed = len(variants) - 1
        calls += variants
    return calls, timed, len(calls) > len(set(batch_sizes))


# -- measurement --------------------------------------------------------------------------------
def _save_workload(calls: list[Inputs], path: Path) -> None:
    arrays = {f"{i}/{name}": arr for i, call in enumerate(calls) for name, arr in call.items()}
    np.savez(path, **arrays)  # type: ignore[arg-type]


def _load_workload(path: str) -> list[Inputs]:
    calls: dict[int, Inputs] = {}
    with np.load(path) as z:
        for key in z.files:
            i, _, name = key.partition("/")
            calls.setdefault(int(i), {})[name] = z[key]
    return [calls[i] for i in sorted(calls)]


def _measure_once(
    model: Path, npz: Path, setting: MemorySetting, runs: int, timed: int, timeout: float
) -> Row:
    try:
        model = session_path(model, setting)  # written here, so the child's peak excludes it
    except Exception as err:  # a graph that cannot be saved with external data: that row only
        return {"error": f"external weights: {str(err)[:300]}"}
    cmd = [
        sys.executable, "-m", "slimline.edge.memory", "--onnx", str(model), "--workload",
        str(npz), "--setting", json.dumps(setting.model_dump()), "--runs", str(runs),
        "--timed", str(timed),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(setting.threads)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"the measurement ran past {timeout:g} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the measuring process failed: {last[:300]}"}
    row: Row = json.loads(proc.stdout.strip().splitlines()[-1])
    return row


def _combine(setting: MemorySetting, rounds: list[Row]) -> Row:
    """One row per setting: the highest peak over its rounds, the median of their latencies."""
    ok = [r for r in rounds if "error" not in r]
    row: Row = {"setting": setting.model_dump(), "label": setting.label}
    if not ok:
        return {**row, "error": rounds[0]["error"]}
    return {
        **row,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ok),
        "baseline_rss_mb": min(r["baseline_rss_mb"] for r in ok),
        "model_rss_mb": max(r["peak_rss_mb"] - r["baseline_rss_mb"] for r in ok),
        "p50_ms": round(float(np.median([r["p50_ms"] for r in ok])), 4),
        "p99_ms": round(float(np.median([r["p99_ms"] for r in ok])), 4),
        "rounds": len(ok),
    }


def measure_settings(
    model: Path,
    calls: list[Inputs],
    settings: Sequence[MemorySetting],
    *,
    timed: int = 0,
    runs: int = 50,
    rounds: int = 1,
    timeout: float = 600,
) -> list[Row]:
    """Each setting measured in fresh subprocesses, ``rounds`` times, the settings interleaved
    (A B C, C B A, ...) so a machine that drifts moves them alike. A setting whose process
    fails is kept with its ``error`` and never picked."""
    results: dict[int, list[Row]] = {i: [] for i in range(len(settings))}
    with tempfile.TemporaryDirectory() as tmp:
        npz = Path(tmp) / "workload.npz"
        _save_workload(calls, npz)
        for r in range(rounds):
            order = range(len(settings)) if r % 2 == 0 else reversed(range(len(settings)))
            for i in order:
                results[i].append(_measure_once(model, npz, settings[i], runs, timed, timeout))
    return [_combine(s, results[i]) for i, s in enumerate(settings)]


# -- choice ---------------------------------------------------------------------------------------
def _speed(row: Row) -> tuple[float, float]:
    return (row["p50_ms"], row["p99_ms"])


def choose(rows: list[Row], budget_mb: float) -> Row:
    """The fastest measured row (p50 at the smallest batch, then p99) whose peak RSS is at most
    ``budget_mb``. Raises :class:`MemoryBudgetError` naming the smallest peak when none fits."""
    measured = [r for r in rows if "error" not in r]
    if not measured:
        why = rows[0]["error"] if rows else "no setting was measured"
        raise SlimlineError(f"no memory setting could be measured ({why})")
    fits = [r for r in measured if r["peak_rss_mb"] <= budget_mb]
    if not fits:
        least = min(measured, key=lambda r: (r["peak_rss_mb"], _speed(r)))
        raise MemoryBudgetError(
            f"memory budget {budget_mb:g} MB is below every measured setting: the smallest peak "
            f"RSS is {least['peak_rss_mb']:g} MB ({least['label']}); raise the budget to at "
            "least that or serve a smaller model"
        )
    return min(fits, key=_speed)


def _is_default(row: Row, threads: int) -> bool:
    return MemorySetting.model_validate(row["setting"]) == MemorySetting(threads=threads)


def memory_profile(
    model: Path,
    sample: Callable[[int], Inputs],
    batch_sizes: Sequence[int],
    threads: int,
    budget_mb: float,
    *,
    runs: int = 50,
    rounds: int = 1,
) -> dict[str, Any]:
    """Measure every setting of :func:`settings_grid` on ``model`` and choose under the budget.

    Returns the profile the manifest records (``budget_mb``, ``batch_sizes``, ``rows``,
    ``chosen``, ``default``: ONNX Runtime's defaults at ``threads``). When nothing fits, the
    raised :class:`MemoryBudgetError` carries that profile (``chosen`` None)."""
    started = time.monotonic()
    calls, timed, varying = workload(model, sample, batch_sizes)
    grid = settings_grid(threads, varying)
    rows = measure_settings(model, calls, grid, timed=timed, runs=runs, rounds=rounds)
    profile: dict[str, Any] = {
        "budget_mb": budget_mb,
        "batch_sizes": sorted(set(batch_sizes)),
        "varying_shapes": varying,
        "model": Path(model).name,
        "rows": rows,
        "default": next((r for r in rows if _is_default(r, threads)), None),
        "chosen": None,
    }
    try:
        profile["chosen"] = choose(rows, budget_mb)
    except MemoryBudgetError as err:
        raise MemoryBudgetError(str(err), profile) from None
    finally:
        profile["seconds"] = round(time.monotonic() - started, 1)
    return profile


def chosen_setting(profile: dict[str, Any] | None) -> MemorySetting | None:
    """The setting a recorded profile chose, if any."""
    chosen = (profile or {}).get("chosen")
    return MemorySetting.model_validate(chosen["setting"]) if chosen else None


# -- the measuring process ------------------------------------------------------------------------
def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker(argv: list[str]) -> Row:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--onnx", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--setting", required=True)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--timed", type=int, default=0, help="index of the call whose latency counts")
    a = p.parse_args(argv)
    setting = MemorySetting.model_validate_json(a.setting)
    calls = _load_workload(a.workload)
    import onnxruntime as ort  # the runtime's import cost is the baseline

    base = _status_mb("VmRSS")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as `serve` runs it
    setting.apply(so)
    sess = ort.InferenceSession(a.onnx, so, providers=["CPUExecutionProvider"])
    frozen = frozen_from_json(sess.get_modelmeta().custom_metadata_map.get(FROZEN_KEY))
    takes = {i.name for i in sess.get_inputs()}
    calls = [drop_frozen(c, takes, frozen, Path(a.onnx).name) for c in calls]
    run_options = setting.run_options()
    times: list[float] = []
    for call in calls:
        for _ in range(2):
            sess.run(None, call, run_options)
    for _ in range(a.runs):
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            sess.run(None, call, run_options)
            if i == a.timed:
                times.append((time.perf_counter() - t0) * 1000)
    peak = _status_mb("VmHWM")
    return {
        "peak_rss_mb": round(peak, 1),
        "baseline_rss_mb": round(base, 1),
        "p50_ms": round(float(np.percentile(times, 50)), 4),
        "p99_ms": round(float(np.percentile(times, 99)), 4),
    }


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1:])))
