"""CI gate: compare a run's manifest with a baseline manifest and fail on regressions.

A latency regression counts only when it exceeds both the tolerance (relative p50 increase) and
the measured noise (the candidate's p50 band lies entirely above the baseline's band). A metric
regression counts when the metric dropped by more than the allowed absolute drop; so does the
agreement of each output the recipe declares by kind (top-1, map IoU, decoded text, boxes:
``fidelity.declared``), which is what the task sees where the metric is only FP32-relative.

Latency compares only across like targets: :func:`hardware_differences` names what differs
between the two manifests' CPUs (the INT8 features, which decide the kernels ONNX Runtime
runs), core and thread counts, and ONNX Runtime versions. :func:`environment_differences` names
the packages that differ from each run's lock (``constraints.txt``) and between the two runs: a
reason to distrust a comparison, printed as a warning, never a failure (an upgrade of the lock is
itself checked this way, against a baseline from before it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cpu import kernel_view

__all__ = ["Regression", "compare_manifests", "environment_differences", "hardware_differences"]


@dataclass
class Regression:
    candidate: str
    figure: str
    baseline: float
    current: float
    detail: str

    def __str__(self) -> str:
        return f"REGRESSION {self.candidate}: {self.figure} {self.baseline:.4g} -> {self.current:.4g} ({self.detail})"


def _by_name(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in manifest["candidates"] if not c.get("alternative")}


def _latency(name: str, base: dict[str, Any], cur: dict[str, Any], tol: float) -> Regression | None:
    b, c = base.get("latency_ms"), cur.get("latency_ms")
    if not b or not c:
        return None
    rel = c["p50"] / b["p50"] - 1.0
    beyond_band = c["band"][0] > b["band"][1]
    if rel > tol and beyond_band:
        return Regression(
            name,
            "latency p50 ms",
            b["p50"],
            c["p50"],
            f"+{rel:.1%} > {tol:.0%} tolerance, band {c['band'][0]:.3f}-{c['band'][1]:.3f} "
            f"above baseline band {b['band'][0]:.3f}-{b['band'][1]:.3f}",
        )
    return None


def _metric(
    name: str, base: dict[str, Any], cur: dict[str, Any], max_drop: float
) -> Regression | None:
    b, c = (base.get("metric") or {}).get("value"), (cur.get("metric") or {}).get("value")
    if b is None or c is None:
        return None
    drop = b - c
    if drop > max_drop:
        return Regression(name, "metric", b, c, f"drop {drop:.4f} > allowed {max_drop:.4f}")
    return None


def _agreement(
    name: str, base: dict[str, Any], cur: dict[str, Any], max_drop: float
) -> list[Regression]:
    """One regression per declared output whose agreement with FP32 dropped by more than
    ``max_drop``; outputs declared in only one of the runs are not compared."""
    b = (base.get("fidelity") or {}).get("declared") or {}
    c = (cur.get("fidelity") or {}).get("declared") or {}
    out = []
    for output in sorted(set(b) & set(c)):
        bv, cv = b[output].get("agreement"), c[output].get("agreement")
        if bv is None or cv is None:
            continue
        if bv - cv > max_drop:
            kind = c[output].get("kind", "declared")
            out.append(
                Regression(
                    name,
                    f"{kind} agreement of output {output!r}",
                    bv,
                    cv,
                    f"drop {bv - cv:.4f} > allowed {max_drop:.4f}",
                )
            )
    return out


def compare_manifests(
    current: dict[str, Any],
    baseline: dict[str, Any],
    *,
    max_latency_regression: float = 0.10,
    max_metric_drop: float = 0.005,
) -> tuple[list[Regression], list[str]]:
    """Regressions, and notes (candidates compared or missing), of ``current`` vs ``baseline``."""
    cur, base = _by_name(current), _by_name(baseline)
    regressions: list[Regression] = []
    notes: list[str] = []
    for name, b in base.items():
        c = cur.get(name)
        if c is None:
            notes.append(f"{name}: in the baseline but not in this run")
            continue
        for r in (
            _latency(name, b, c, max_latency_regression),
            _metric(name, b, c, max_metric_drop),
        ):
            if r is not None:
                regressions.append(r)
        regressions.extend(_agreement(name, b, c, max_metric_drop))
        if b.get("latency_ms") and c.get("latency_ms"):
            notes.append(
                f"{name}: p50 {b['latency_ms']['p50']:.3f} -> {c['latency_ms']['p50']:.3f} ms"
            )
    return regressions, notes


def _int8_text(int8: dict[str, Any]) -> str:
    present = [k for k, v in int8.items() if k != "kind" and v is True]
    return f"{int8.get('kind')} ({', '.join(present) or 'no INT8 extensions'})"


def _figures(m: dict[str, Any]) -> dict[str, Any]:
    hw = m.get("hardware") or {}
    return {
        "CPU cores": hw.get("cores"),
        "threads": (m.get("target") or {}).get("threads"),
        "onnxruntime": (m.get("versions") or {}).get("onnxruntime"),
        "serving runtime": _serving_runtime(m),
    }


def _serving_runtime(m: dict[str, Any]) -> str | None:
    """The runtime the run picked to serve, with its version (OpenVINO's is not in
    ``versions``); None in manifests from before the runtime choice or with nothing selected."""
    name = m.get("selected_runtime")
    if not name:
        return None
    version = ((m.get("runtimes") or {}).get(name) or {}).get("version")
    return f"{name} {version}" if version else str(name)


def _compare_int8(current: dict[str, Any], baseline: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The INT8 features when both manifests record them; otherwise the older, shorter ``flags``
    list (AVX2, AVX512F, AVX512-VNNI, AMX), saying what could not be compared."""
    chw, bhw = current.get("hardware") or {}, baseline.get("hardware") or {}
    cv, bv = chw.get("int8"), bhw.get("int8")
    if isinstance(cv, dict) and isinstance(bv, dict):
        cv, bv = kernel_view(cv), kernel_view(bv)  # what the kernels saw, not where it was read
        if cv != bv:
            return [f"INT8 CPU features {_int8_text(cv)} vs baseline {_int8_text(bv)}"], []
        return [], []
    older = "this run" if not isinstance(cv, dict) else "the baseline"
    cflags, bflags = chw.get("flags"), bhw.get("flags")
    if cflags is None or bflags is None:
        return [], [f"CPU features (not recorded in {older})"]
    unknown = [f"AVX512BW and AVX-VNNI (not recorded in {older}; its CPU flags list was compared)"]
    if sorted(cflags) != sorted(bflags):
        return [
            f"CPU flags {', '.join(cflags) or '-'} vs baseline {', '.join(bflags) or '-'}"
        ], unknown
    return [], unknown


def hardware_differences(
    current: dict[str, Any], baseline: dict[str, Any]
) -> tuple[list[str], list[str]]:
    """(what differs, what one of the manifests does not record) between two runs' targets."""
    differs, unknown = _compare_int8(current, baseline)
    cur, base = _figures(current), _figures(baseline)
    for name, c in cur.items():
        b = base[name]
        if c is None and b is None and name == "serving runtime":
            continue  # two manifests from before the runtime choice: both served ONNX Runtime
        if c is None or b is None:
            side = "this run" if c is None else "the baseline"
            unknown.append(f"{name} (not recorded in {side})")
        elif c != b:
            differs.append(f"{name} {c} vs baseline {b}")
    return differs, unknown


# ``versions`` entries that differ on purpose between two runs of a change (the code under test)
# or are compared as the target already (:func:`hardware_differences`)
_NOT_PACKAGES = ("slimline", "slimline_code", "onnxruntime")
_LISTED = 8  # packages named in one line; the rest are counted


def _pkg_list(differs: dict[str, Any]) -> str:
    items = [
        f"{name} {d.get('installed') or 'not installed'} (locked {d.get('locked')})"
        for name, d in sorted(differs.items())
    ]
    more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return ", ".join(items[:_LISTED]) + more


def _against_lock(m: dict[str, Any], side: str) -> tuple[list[str], list[str]]:
    lock = (m.get("environment") or {}).get("lock")
    if not isinstance(lock, dict):
        return [], [f"package lock (not recorded in {side})"]
    if lock.get("matches") is None:
        return [], [f"package lock ({side}: {lock.get('state')})"]
    if lock["matches"]:
        return [], []
    name = Path(str(lock.get("file"))).name
    return [f"{side}'s packages differ from its lock {name}: {_pkg_list(lock['differs'])}"], []


def environment_differences(
    current: dict[str, Any], baseline: dict[str, Any]
) -> tuple[list[str], list[str]]:
    """(warnings, what could not be compared) about the two runs' package sets: each run against
    its lock, the two locks, and the package versions both manifests record."""
    warnings, unknown = _against_lock(current, "this run")
    w, u = _against_lock(baseline, "the baseline")
    warnings, unknown = warnings + w, unknown + u
    clock = (current.get("environment") or {}).get("lock") or {}
    block = (baseline.get("environment") or {}).get("lock") or {}
    if clock.get("sha256") and block.get("sha256") and clock["sha256"] != block["sha256"]:
        warnings.append(
            f"the baseline ran with another lock (sha256 {block['sha256'][:12]}, this run "
            f"{clock['sha256'][:12]})"
        )
    cv, bv = current.get("versions") or {}, baseline.get("versions") or {}
    changed = [
        f"{k} {cv[k]} vs baseline {bv[k]}"
        for k in sorted(set(cv) & set(bv))
        if k not in _NOT_PACKAGES and cv[k] != bv[k]
    ]
    if changed:
        warnings.append(f"package versions differ from the baseline's: {', '.join(changed)}")
    return warnings, unknown
