"""Accept or reject a step's candidate against its parent (:func:`decide`).

A candidate is kept only if it is within the recipe's budget (task metric and fidelity against
the FP32 reference) AND measurably faster than its parent in an interleaved comparison (or
smaller, with ``objective: size``). With several runtimes (``target.runtime: auto``) it is
judged on each, and kept if one keeps it; each runtime's verdict goes into its meta. A decision
is cached under a key of both models and of what measuring depends on (``--remeasure`` judges
again).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..candidate import Candidate, is_ir
from ..errors import error_text, is_user_error
from ..measure.latency import DECISIVE_MARGIN, pool_rounds, speed_verdict
from ..recipe import StepConfig
from ..record import json_hash
from .measurement import (
    compare,
    file_size,
    measure_key_parts,
    planned_rounds,
    quality_of,
    settled_pooled,
    settled_slower,
    step_context,
)
from .state import Run, log, step_key, stopwatch

__all__ = ["decide"]


def decide(run: Run, cfg: StepConfig, parent: Candidate, cand: Candidate) -> tuple[bool, str]:
    """(kept, why) for ``cand``, made by step ``cfg`` from ``parent``: the cached decision, or
    a verdict on each runtime of the run (kept where one runtime keeps it)."""
    key = json_hash(
        {
            "decide": step_key(run, cfg, parent),
            "cand": cand.content_hash(),
            "parent": parent.content_hash(),
            **measure_key_parts(run),
        }
    )
    cached = None if run.remeasure else run.cache.get_json("decision", key)
    if cached is None:
        verdicts = _judge_runtimes(run, parent, cand)
        accepted = any(v["accepted"] for v in verdicts.values())
        if len(verdicts) == 1:
            reason = next(iter(verdicts.values()))["reason"]
        else:
            reason = "; ".join(f"{rt}: {v['reason']}" for rt, v in verdicts.items())
        cached = {"accepted": accepted, "reason": reason, "runtimes": verdicts}
        run.cache.put_json("decision", key, cached)
    if len(run.runtimes) > 1:
        cand.meta = {**cand.meta, "runtime_verdicts": cached.get("runtimes", {})}
    return bool(cached["accepted"]), str(cached["reason"])


def _judge_runtimes(run: Run, parent: Candidate, cand: Candidate) -> dict[str, dict[str, Any]]:
    """The accept/reject verdict of ``cand`` against ``parent`` on each runtime of the run.

    With several runtimes, a candidate (or its parent) that one runtime cannot load or run is
    rejected on that runtime with the runtime's message; the other runtime's verdict stands."""
    if len(run.runtimes) == 1:
        with stopwatch(f"judge {cand.name} on {run.runtimes[0]}", run):
            ok, why = _judge(run, parent, cand, run.runtimes[0])
        return {run.runtimes[0]: {"accepted": ok, "reason": why}}
    verdicts: dict[str, dict[str, Any]] = {}
    for rt in run.runtimes:
        timing: dict[str, Any] = {}
        try:
            with stopwatch(f"judge {cand.name} on {rt}", run):
                ok, why = _judge(run, parent, cand, rt, timing)
        except Exception as err:
            if is_user_error(err):
                raise
            ok, why = False, f"failed: {error_text(err)}"
        verdicts[rt] = {"accepted": ok, "reason": why, **({"timing": timing} if timing else {})}
    return verdicts


def _judge(
    run: Run,
    parent: Candidate,
    cand: Candidate,
    runtime: str,
    timing: dict[str, Any] | None = None,
) -> tuple[bool, str]:
    """(kept, why) for ``cand`` against ``parent`` on ``runtime``; ``timing`` receives the
    comparison's figures when one was timed."""
    assert run.reference is not None
    ctx = step_context(run, run.out)
    quality = quality_of(run, cand, runtime)
    ok, budget_reason = ctx.within_budget(quality)
    if not ok:
        return False, budget_reason
    b = run.recipe.budget
    if b.objective == "size":
        return _judge_size(parent, cand, b.min_gain, budget_reason)
    same = _same_executed_graph(run, parent, cand, runtime)
    if same is not None:
        return False, f"not measurably faster than {parent.name}: {same}; {budget_reason}"
    verdict, pair, lat, planned = _timed_verdict(run, parent, cand, runtime)
    p, c = pair.pop("parent"), pair.pop("cand")
    ratio = c["p50"] / p["p50"]
    if timing is not None:
        timing.update(_timing_record(parent.name, p, c, pair))
    pc, cc = lat[parent.name]["cpu_ms"]["p50"], lat[cand.name]["cpu_ms"]["p50"]
    figures = (
        f"p50 {c['p50']:.3f} ms vs {p['p50']:.3f} ms ({ratio:.2f}x of {parent.name}; "
        f"CPU time {cc / pc:.2f}x; {_pair_text(pair)})"
    )
    if pair["rounds"] < planned:
        figures += f"; stopped after {pair['rounds']} of {planned} rounds: " + (
            (
                "enough of them won for the sign test whatever the later rounds gave"
                if planned > planned_rounds(run)
                else f"each won by far (at most {DECISIVE_MARGIN * (1 - b.min_gain):.2f}x), "
                "the bands apart"
            )
            if verdict == "faster"
            else f"it missed the {b.min_gain:.0%} gain in more than half of them, which no "
            "later round changes"
        )
    if verdict != "faster":
        why = "slower than" if pair["ratio"] > 1.0 else "not measurably faster than"
        return False, f"{why} {parent.name}: {figures}; {budget_reason}"
    if b.p99_ms is not None and c["p99"] > b.p99_ms:
        run.warnings.append(f"{cand.name}: p99 {c['p99']:.2f} ms is above the target {b.p99_ms} ms")
    return True, f"faster: {figures}; {budget_reason}"


def _timed_verdict(
    run: Run, parent: Candidate, cand: Candidate, runtime: str
) -> tuple[str, dict[str, Any], dict[str, dict[str, Any]], int]:
    """(verdict, pair, last benchmark's figures, rounds planned) of ``cand`` against ``parent``
    on ``runtime``, timed interleaved; ``pair`` holds the pooled latencies under ``parent`` and
    ``cand``. Each benchmark stops once its verdict is settled (:func:`settled_slower`,
    :func:`settled_pooled`)."""
    b = run.recipe.budget
    planned = planned_rounds(run)
    reused = _search_rounds(run, parent, cand, runtime)
    if reused is not None:
        lat = reused
    else:
        until = settled_slower(run, parent, cand)
        lat = compare(run, [parent, cand], runtime=runtime, until=until)
    p, c = lat[parent.name]["latency_ms"], lat[cand.name]["latency_ms"]
    verdict, pair = speed_verdict(p, c, b.min_gain)
    pair["reused"] = reused is not None
    if verdict == "inconclusive":
        # Enough gain at the median, but the rounds disagree: a drifting machine, not an answer.
        # Measure again with twice the rounds and decide on all of them, paired by round.
        log.info(
            "step %s: speed vs %s inconclusive (%s); measuring again",
            cand.name,
            parent.name,
            _pair_text(pair),
        )
        planned = 3 * planned
        lat = compare(
            run,
            [parent, cand],
            rounds=2 * run.recipe.bench.rounds,
            runtime=runtime,
            until=settled_pooled(run, parent, cand, p, c),
        )
        p = pool_rounds(p, lat[parent.name]["latency_ms"])
        c = pool_rounds(c, lat[cand.name]["latency_ms"])
        verdict, pair = speed_verdict(p, c, b.min_gain)
    return verdict, {**pair, "parent": p, "cand": c}, lat, planned


def _same_executed_graph(run: Run, parent: Candidate, cand: Candidate, runtime: str) -> str | None:
    """Why timing a graph step's output against its parent on ONNX Runtime is pointless, or
    None: ONNX Runtime applies the graph step's optimizations itself at load time, and when the
    two optimized graphs it runs are the same (every node with its attributes and producers,
    every weight bit for bit), nothing can be faster. Measured on the runtime's own saved graphs,
    not assumed; a failure to compare times the pair as usual."""
    if runtime != "onnxruntime" or cand.step != "graph" or cand.onnx is None or parent.onnx is None:
        return None
    if is_ir(cand.onnx) or is_ir(parent.onnx):
        return None
    try:
        a = executed_graph(parent.onnx, run.threads)
        b = executed_graph(cand.onnx, run.threads)
    except Exception as err:
        if is_user_error(err):
            raise
        log.info("step %s: executed graphs not compared: %s", cand.name, error_text(err))
        return None
    if a != b:
        return None
    nodes = sum(a[0].values())
    return (
        f"ONNX Runtime runs the same graph for both after its load-time optimization ({nodes} "
        "nodes, identical weights), so it was not timed"
    )


def executed_graph(path: Any, threads: int) -> tuple[Counter[Any], Counter[Any]]:
    """What ONNX Runtime runs for the model at ``path``: its load-time optimized graph as a
    multiset of nodes (type, domain, attributes, and what feeds each input: a weight's hash, a
    graph input, or a producer's type and output index) and a multiset of weights."""
    import hashlib
    import tempfile
    from pathlib import Path

    import onnx
    from onnx import numpy_helper

    from ..measure.runners import ort_session

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "optimized.onnx"
        ort_session(Path(path), threads, optimized_out=out)
        model = onnx.load(str(out))
    g = model.graph
    weights = {
        i.name: (
            tuple(i.dims),
            i.data_type,
            hashlib.sha1(numpy_helper.to_array(i).tobytes()).hexdigest(),
        )
        for i in g.initializer
    }
    made = {o: (n.op_type, k) for n in g.node for k, o in enumerate(n.output)}

    def fed_by(name: str) -> Any:
        if name in weights:
            return ("weight", weights[name])
        return ("node", made[name]) if name in made else ("input", name)

    nodes = Counter(
        (
            n.op_type,
            n.domain,
            tuple(sorted(a.SerializeToString() for a in n.attribute)),
            tuple(fed_by(i) for i in n.input),
        )
        for n in g.node
    )
    return nodes, Counter(weights.values())


def _search_rounds(
    run: Run, parent: Candidate, cand: Candidate, runtime: str
) -> dict[str, dict[str, Any]] | None:
    """The step's own interleaved rounds of ``cand`` against ``parent``, where they are this
    verdict's comparison: the quantize search timed its pick against the FP32 baseline on the
    run's first runtime, every planned round, with the same bench settings (part of the step's
    key). Paired by round like a fresh comparison, so the verdict reads them instead of timing
    the pair again; None where they are not the same comparison."""
    prior = (cand.measurement or {}).get("timed_with_baseline")
    lat = (cand.measurement or {}).get("latency_ms")
    if not prior or not lat or runtime != run.runtimes[0]:
        return None
    if parent.name != prior.get("against") or parent.name != run.baseline.name:
        return None
    base = prior["baseline_latency_ms"]
    planned = planned_rounds(run)
    if (
        len(lat.get("per_round_p50", [])) != planned
        or len(base.get("per_round_p50", [])) != planned
    ):
        return None
    return {
        parent.name: {"latency_ms": base, "cpu_ms": {"p50": prior["baseline_cpu_p50_ms"]}},
        cand.name: {"latency_ms": lat, "cpu_ms": {"p50": prior["cpu_p50_ms"]}},
    }


def _timing_record(
    parent: str, p: dict[str, Any], c: dict[str, Any], pair: dict[str, Any]
) -> dict[str, Any]:
    """A verdict's latency figures: the candidate against its parent, interleaved at batch 1."""
    return {
        "against": parent,
        "p50_ms": c["p50"],
        "band_ms": c["band"],
        "parent_p50_ms": p["p50"],
        "parent_band_ms": p["band"],
        "ratio": pair["ratio"],
        "rounds": pair["rounds"],
    }


def _pair_text(pair: dict[str, Any]) -> str:
    where = " (the quantize search's rounds)" if pair.get("reused") else ""
    return (
        f"faster in {pair['faster_rounds']} of {pair['rounds']} interleaved rounds{where}, "
        f"median per-round ratio {pair['ratio']:.2f}, sign test p={pair['p_value']:.3f}"
    )


def _judge_size(parent: Candidate, cand: Candidate, min_gain: float, why: str) -> tuple[bool, str]:
    ps, cs = file_size(parent), file_size(cand)
    if ps is None or cs is None:
        return False, "size objective needs ONNX artifacts on both sides"
    ratio = cs / ps
    figures = f"{cs} vs {ps} bytes ({ratio:.2f}x of {parent.name})"
    if ratio > 1.0 - min_gain:
        return False, f"not measurably smaller: {figures}; {why}"
    return True, f"smaller: {figures}; {why}"
