"""Runtime auto: the pick among the measured (runtime, candidate) pairs, and each candidate's
figures on the runtime that serves.

A pair is eligible when its candidate is the FP32 baseline or its step was accepted on that
runtime (measurably faster than its parent there): the pipeline's accept/reject rule, on the
runtime that will serve. Among eligible pairs within budget, the fastest p50 at batch 1 wins.
"""

from __future__ import annotations

from typing import Any

from .candidate import Candidate
from .runtimes import Pair, pick_pair
from .steps import kinds_producing

__all__ = ["BASELINE", "accepted_on", "apply_pick", "pairs_of", "side_by_side"]

BASELINE = "fp32-onnx"


def accepted_on(c: Candidate, runtime: str) -> bool:
    """Whether ``c`` can be the pick on ``runtime``: the baseline, or its step was kept there
    (a candidate judged before verdicts were kept per runtime: its one verdict)."""
    if c.name == BASELINE:
        return True
    verdicts = c.meta.get("runtime_verdicts") or {}
    verdict = verdicts.get(runtime)
    return bool(verdict["accepted"]) if verdict is not None else bool(c.accepted)


def pairs_of(cands: list[Candidate]) -> list[Pair]:
    """Every measured (runtime, candidate) pair of ONNX candidates."""
    pairs: list[Pair] = []
    for c in cands:
        if c.onnx is None:
            continue
        for rt, f in ((c.measurement or {}).get("runtimes") or {}).items():
            if "failed" in f or "latency_ms" not in f:  # not loadable, or not timed: no pick
                continue
            pairs.append(
                Pair(
                    runtime=rt,
                    candidate=c.name,
                    p50_ms=float(f["latency_ms"]["p50"]),
                    within_budget=bool(f.get("within_budget")),
                    eligible=accepted_on(c, rt),
                    why=str(f.get("budget_reason", "")),
                )
            )
    return pairs


def side_by_side(cands: list[Candidate]) -> list[dict[str, Any]]:
    """FP32 and the fastest eligible INT8 within budget, on each runtime, for the report. An
    INT8 candidate is one made by a step whose contract produces a quantized ONNX graph."""
    rows: list[dict[str, Any]] = []
    pairs = pairs_of(cands)
    int8_steps = kinds_producing("onnx-int8")
    int8 = {c.name for c in cands if c.step in int8_steps}
    for rt in sorted({p.runtime for p in pairs}):
        fp32 = next((p for p in pairs if p.runtime == rt and p.candidate == BASELINE), None)
        best = pick_pair(p for p in pairs if p.runtime == rt and p.candidate in int8)
        for label, p in (("FP32", fp32), ("best INT8", best)):
            if p is not None:
                rows.append(
                    {"runtime": rt, "kind": label, "candidate": p.candidate, "p50_ms": p.p50_ms}
                )
    return rows


def apply_pick(cands: list[Candidate], runtimes: list[str]) -> dict[str, Any]:
    """The pick (the manifest's ``runtime_pick``); sets each candidate's top-level figures to
    those on the picked runtime (the other runtime's stay under ``runtimes``)."""
    pairs = pairs_of(cands)
    pick = pick_pair(pairs)
    if pick is None:  # not even the baseline within budget on a runtime: serve it on the first
        pick = next((p for p in pairs if p.candidate == BASELINE), None)
    record = {
        "runtime": pick.runtime if pick else runtimes[0],
        "candidate": pick.candidate if pick else None,
        "p50_ms": pick.p50_ms if pick else None,
        "rule": "fastest p50 at batch 1 among (runtime, candidate) pairs within budget whose "
        "step was accepted on that runtime",
        "pairs": [p.__dict__ for p in pairs],
        "side_by_side": side_by_side(cands),
    }
    serving = str(record["runtime"])
    for c in cands:
        per_runtime = (c.measurement or {}).get("runtimes") or {}
        shown: dict[str, Any] = per_runtime.get(serving) or {"failed": ""}
        if "failed" in shown:
            shown = next((f for f in per_runtime.values() if "failed" not in f), {})
        c.measurement = {**shown, "runtimes": per_runtime}
    return record
