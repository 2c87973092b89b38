"""The CPU runtimes a candidate can be measured and served on, and the choice between them.

``target.runtime`` is ``onnxruntime``, ``openvino`` or ``auto``. With ``auto`` every candidate
is measured on both runtimes, the budget is checked per (runtime, candidate) pair (the two
runtimes' outputs differ slightly), and the pick is the fastest pair within budget among the
pairs whose step was accepted on that runtime (:func:`pick_pair`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RUNTIMES",
    "Pair",
    "pair_name",
    "pick_pair",
    "runtime_record",
    "runtimes_for",
    "split_pair_name",
]

RUNTIMES = ("onnxruntime", "openvino")
_SEP = "@"


def runtimes_for(target_runtime: str) -> list[str]:
    """The runtimes a target measures on; the OpenVINO package is required for ``openvino``
    and ``auto`` (a one-line error naming the extra when it is missing)."""
    if target_runtime not in (*RUNTIMES, "auto"):
        raise ValueError(f"unknown runtime {target_runtime!r}")
    if target_runtime in ("openvino", "auto"):
        from .measure.ov import require_openvino

        require_openvino()
    return list(RUNTIMES) if target_runtime == "auto" else [target_runtime]


def runtime_record(runtime: str, threads: int) -> dict[str, Any]:
    """What the manifest records of a runtime: its version and the settings it ran with."""
    if runtime == "openvino":
        from .measure.ov import ov_settings, ov_version

        return {"version": ov_version(), "device": "CPU", "settings": ov_settings(threads)}
    import onnxruntime as ort

    return {
        "version": ort.__version__,
        "provider": "CPUExecutionProvider",
        "settings": {
            "intra_op_num_threads": threads,
            "inter_op_num_threads": 1,
            "execution_mode": "ORT_SEQUENTIAL",
            "graph_optimization_level": "ORT_ENABLE_ALL",
        },
    }


def pair_name(runtime: str, candidate: str) -> str:
    """The benchmark key of one (runtime, candidate) pair: ``candidate@runtime``."""
    return f"{candidate}{_SEP}{runtime}"


def split_pair_name(name: str) -> tuple[str, str]:
    """``(runtime, candidate)`` of a :func:`pair_name`."""
    cand, _, runtime = name.rpartition(_SEP)
    return runtime, cand


@dataclass(frozen=True)
class Pair:
    """One (runtime, candidate) pair as measured: its p50 at batch 1, and whether it is within
    budget and eligible (its step was accepted on that runtime, or it is the baseline)."""

    runtime: str
    candidate: str
    p50_ms: float
    within_budget: bool
    eligible: bool
    why: str = ""


def pick_pair(pairs: Iterable[Pair]) -> Pair | None:
    """The fastest eligible pair within budget, or None when there is none."""
    ok = [p for p in pairs if p.eligible and p.within_budget]
    return min(ok, key=lambda p: p.p50_ms) if ok else None
