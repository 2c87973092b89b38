"""The final measurement of a run (:func:`measure_all`), after its last step.

Every candidate of the chain is timed interleaved in one benchmark (latency at batch 1 and
throughput at the bench's batch sizes), then its quality, size and peak RSS are measured. With
runtime auto, each (runtime, candidate) pair that can be the pick is timed on its runtime and
the pick is made (:func:`slimline.pick.apply_pick`). A baseline that drifted between rounds is
timed again; other work on the machine is sampled before and after and recorded. The figures
are cached like a decision (``--remeasure`` measures again). Then the per-operator profiles
(:func:`profile_or_warn`) and, with a memory budget, the memory profile of the selected
candidate (:func:`profile_memory`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..candidate import Candidate, is_ir
from ..context import StepContext
from ..errors import error_text, is_user_error
from ..measure.latency import DRIFT_SPREAD, Retire, benchmark, pool_rounds, round_drift
from ..measure.memory import peak_rss
from ..measure.quality import Quality
from ..recipe import BenchConfig
from ..record import json_hash
from ..task import Inputs
from .measurement import file_size, measure_key_parts, param_count, quality_of, step_context
from .state import Run, has_failed, log, stopwatch

__all__ = ["measure_all", "out_of_the_race", "profile_memory", "profile_or_warn"]

BUSY_CORES = 0.5  # other work using this much CPU during a measurement makes it unreliable


def measure_all(run: Run) -> None:
    """The final figures of every candidate that did not fail (with runtime auto, the rivals
    too, and the pick), measured or from the cache, into each candidate's ``measurement``."""
    cands = [c for c in run.chain if not has_failed(c)]
    if len(run.runtimes) > 1:  # rivals (NNCF): measured on both; the pick if accepted there
        cands += [a for a in run.alternatives if a.meta.get("competes") and not has_failed(a)]
    # with several runtimes, which pairs are timed follows the verdicts: part of the key
    timed = {"timed": sorted(_pairs_to_time(run, cands))} if len(run.runtimes) > 1 else {}
    key = json_hash(
        {
            "measure": [c.content_hash() for c in cands],
            "names": [c.name for c in cands],
            "data": run.hashes,
            **measure_key_parts(run),
            **timed,
        }
    )
    cached = None if run.remeasure else run.cache.get_json("measure", key)
    if cached is None:
        cached = (
            _measure_fresh(run, cands) if len(run.runtimes) == 1 else _measure_pairs(run, cands)
        )
        run.cache.put_json("measure", key, cached)
    else:
        log.info("measurement: reusing cached figures (use --remeasure to measure again)")
    for c in cands:
        c.measurement = cached[c.name]
    if len(run.runtimes) > 1:
        from ..pick import apply_pick

        run.extra["runtime_pick"] = apply_pick(cands, run.runtimes)
    for alt in run.alternatives:
        alt.measurement = {**(alt.measurement or {}), "size_bytes": file_size(alt)}


def _final_benchmark(
    run: Run,
    cands: list[Candidate],
    sample: Inputs,
    desc: str,
    pairs: set[str] | None = None,
    retire: Retire | None = None,
) -> dict[str, dict[str, Any]]:
    """The final interleaved benchmark of ``cands`` on every runtime of the run (only ``pairs``
    where given), timed as the run's "final benchmark" phase."""
    with stopwatch("final benchmark", run):
        return benchmark(
            cands,
            sample,
            run.recipe.bench,
            run.threads,
            desc=desc,
            signature=run.task.signature,
            runtimes=run.runtimes,
            pairs=pairs,
            retire=retire,
        )


def out_of_the_race(contenders: set[str], rounds: int, stopped: dict[str, str]) -> Retire:
    """Leaves a pair out of the final benchmark's later rounds once its median p50 cannot fall
    below a contender's (an eligible pair within budget) whatever the later rounds give: the
    pair's remaining rounds instant, the contender's endless. The pick is the contender with the
    lowest median, so such a pair is not the pick, and stopping it changes no pick; its figures
    cover the rounds it ran. The pick itself never leaves; when it is the last pair left, the
    benchmark ends. ``stopped`` receives why, per pair."""

    def retire(p50s: dict[str, list[float]]) -> list[str]:
        out = []
        for name, seen in p50s.items():
            if not seen or len(seen) >= rounds or name in stopped:
                continue
            low = float(np.median([*seen, *([0.0] * (rounds - len(seen)))]))
            for other in sorted(contenders - {name}):
                theirs = p50s.get(other) or []
                if not theirs:
                    continue
                high = float(np.median([*theirs, *([np.inf] * (rounds - len(theirs)))]))
                if low > high:
                    stopped[name] = (
                        f"timed {len(seen)} of {rounds} rounds: its median p50 could no longer "
                        f"fall below {other}'s"
                    )
                    out.append(name)
                    break
        return out

    return retire


def _contenders(run: Run, cands: list[Candidate], timed: set[str]) -> set[str]:
    """The timed pairs that can be the pick: eligible (all timed pairs are) and within budget,
    from the quality their verdicts already measured (evaluated once per file and runtime, so
    this costs nothing the final figures would not)."""
    from ..runtimes import pair_name

    ctx = step_context(run, run.out)
    out: set[str] = set()
    for c in cands:
        for rt in run.runtimes if c.onnx is not None else []:
            key = pair_name(rt, c.name)
            if key not in timed:
                continue
            try:
                if ctx.within_budget(quality_of(run, c, rt))[0]:
                    out.add(key)
            except Exception as err:  # the pair fails to run: its figures say so later
                if is_user_error(err):
                    raise
    return out


def _measure_fresh(run: Run, cands: list[Candidate]) -> dict[str, dict[str, Any]]:
    bench: BenchConfig = run.recipe.bench
    sample = run.task.sample_inputs(max(bench.batch_sizes))
    before = _load_check(run, "before")
    figures = _final_benchmark(run, cands, sample, "measure all candidates")
    if _baseline_drift(figures) is not None:
        # The machine changed speed mid-benchmark. Time batch 1 again with twice the rounds
        # and pool them: more pairs, so a round split across two speed modes moves the median
        # ratios less. Throughput and memory keep the first pass.
        rounds = 2 * bench.rounds
        log.info("baseline latency drifted between rounds; timing batch 1 again, %d rounds", rounds)
        again = benchmark(
            cands,
            sample,
            bench.model_copy(update={"rounds": rounds}),
            run.threads,
            throughput=False,
            desc="measure again (drift)",
            signature=run.task.signature,
            runtimes=run.runtimes,
        )
        for c in cands:
            f, g = figures[c.name], again[c.name]
            f["latency_ms"] = pool_rounds(f["latency_ms"], g["latency_ms"])
            f["latency_samples_ms"] = f["latency_samples_ms"] + g["latency_samples_ms"]
    after = _load_check(run, "after")
    _record_conditions(run, _drift_check(run, figures), before, after)
    rss_sample = _rss_sample(run, sample)
    with stopwatch("final quality, size and peak RSS", run):
        for c in cands:
            _add_quality_and_memory(run, c, figures[c.name], rss_sample, run.runtimes[0])
    return figures


def _record_conditions(
    run: Run, spread: Any, before: dict[str, Any], after: dict[str, Any]
) -> None:
    """What the machine was doing around the final benchmark, into the manifest."""
    run.extra["measurement_conditions"] = {
        "round_spread": spread,
        "other_cores_before": before["other_cores"],
        "other_cores_after": after["other_cores"],
        "load_before": before["load"],
        "load_after": after["load"],
        "cores": os.cpu_count(),
        "threads": run.threads,
    }


def _rss_sample(run: Run, sample: Any) -> Any:
    """The inputs peak RSS is measured on: ``sample`` (the benchmark's largest batch), or one
    row for a model that takes one row per call (its runner is a plain session)."""
    sig = run.task.signature
    return sample if sig is None or sig.max_batch is None else run.task.sample_inputs(1)


def _add_quality_and_memory(
    run: Run, c: Candidate, f: dict[str, Any], rss_sample: Any, runtime: str
) -> Quality:
    """Metric, fidelity, size, parameters and peak RSS of ``c`` on ``runtime``, into ``f``."""
    q = quality_of(run, c, runtime)
    f["metric"] = {"name": run.task.metric_name, "value": q.metric}
    f["fidelity"] = q.fidelity_dict()
    f["size_bytes"], f["params"] = file_size(c), param_count(c)
    bench = run.recipe.bench
    rss = (
        peak_rss(c, rss_sample, run.threads, run.task.source, runtime=runtime)
        if bench.peak_rss
        else None
    )
    f["peak_rss_mb"] = rss["peak_rss_mb"] if rss else None
    f["rss"] = rss
    return q


def _measure_pairs(run: Run, cands: list[Candidate]) -> dict[str, dict[str, Any]]:
    """Runtime auto: the pairs that can be the pick (:func:`_pairs_to_time`) on every runtime,
    interleaved in one benchmark; each (runtime, candidate) pair's quality checked against the
    budget on its own outputs. Returns ``{candidate: {"runtimes": {runtime: figures}}}``; a pair
    a runtime cannot load or run has ``{"failed": why}``, a pair its step was rejected on has
    its quality and its verdict's timing under ``not_timed``/``judged``."""
    from ..runtimes import pair_name

    bench: BenchConfig = run.recipe.bench
    sample = run.task.sample_inputs(max(bench.batch_sizes))
    timed = _pairs_to_time(run, cands)
    stopped: dict[str, str] = {}
    retire = out_of_the_race(_contenders(run, cands, timed), bench.rounds, stopped)
    before = _load_check(run, "before")
    figures = _final_benchmark(
        run, cands, sample, "measure all (runtime, candidate) pairs", timed, retire
    )
    after = _load_check(run, "after")
    spread = {k: round_drift(f["latency_ms"]) for k, f in figures.items() if "latency_ms" in f}
    _record_conditions(run, spread, before, after)
    if stopped:
        run.extra["measurement_conditions"]["rounds_stopped"] = stopped
    rss_sample = _rss_sample(run, sample)
    ctx = step_context(run, run.out)
    out: dict[str, dict[str, Any]] = {c.name: {"runtimes": {}} for c in cands}
    with stopwatch("final quality, size and peak RSS", run):
        for c in cands:
            for rt in run.runtimes if c.onnx is not None else ["torch"]:
                key = pair_name(rt, c.name)
                f = figures[key] if key in timed else _judged_pair(c, rt)
                out[c.name]["runtimes"][rt] = _with_quality(run, ctx, c, rt, f, rss_sample)
    return out


def _pairs_to_time(run: Run, cands: list[Candidate]) -> set[str]:
    """The pairs the final benchmark times: the torch model, the FP32 baseline on every runtime
    (the ratios and the side-by-side view), and each pair whose step was kept on that runtime.
    A pair its step was rejected on (over budget there, not measurably faster than its parent,
    or not loadable) cannot be the pick, so it is not timed again: its verdict has its figures."""
    from ..pick import accepted_on
    from ..runtimes import pair_name

    pairs: set[str] = set()
    for c in cands:
        if c.onnx is None:
            pairs.add(pair_name("torch", c.name))
            continue
        pairs |= {pair_name(rt, c.name) for rt in run.runtimes if accepted_on(c, rt)}
    return pairs


def _judged_pair(c: Candidate, runtime: str) -> dict[str, Any]:
    """The figures of a pair the final benchmark did not time: its verdict on ``runtime``."""
    verdict = (c.meta.get("runtime_verdicts") or {}).get(runtime) or {}
    reason = str(verdict.get("reason") or c.reason or "rejected")
    if reason.startswith("failed: "):
        return {"failed": reason.removeprefix("failed: ")}
    f: dict[str, Any] = {
        "not_timed": f"rejected on {runtime} by its accept/reject test, so never the pick: {reason}"
    }
    if verdict.get("timing"):
        f["judged"] = verdict["timing"]
    return f


def _with_quality(
    run: Run, ctx: StepContext, c: Candidate, rt: str, f: dict[str, Any], rss_sample: Any
) -> dict[str, Any]:
    """``f`` with the pair's quality and budget check, size, and (for a timed pair) peak RSS;
    ``{"failed": why}`` when the pair failed to load, run or evaluate."""
    if "failed" in f:
        return f
    try:
        if "not_timed" in f:
            q = quality_of(run, c, rt)  # evaluated by its verdict already: read, not run again
            f["metric"] = {"name": run.task.metric_name, "value": q.metric}
            f["fidelity"] = q.fidelity_dict()
            f["size_bytes"], f["params"] = file_size(c), param_count(c)
        else:
            q = _add_quality_and_memory(run, c, f, rss_sample, rt)
    except Exception as err:
        if is_user_error(err):
            raise
        return {"failed": error_text(err)}
    f["within_budget"], f["budget_reason"] = ctx.within_budget(q)
    return f


def _baseline_name(figures: dict[str, dict[str, Any]]) -> str:
    return "fp32-onnx" if "fp32-onnx" in figures else next(iter(figures))


def _baseline_drift(figures: dict[str, dict[str, Any]]) -> float | None:
    """The baseline's slowest / fastest round when it exceeds :data:`DRIFT_SPREAD` (every
    ratio of the run is taken against the baseline), else None."""
    spread = round_drift(figures[_baseline_name(figures)]["latency_ms"])
    return spread if spread is not None and spread > DRIFT_SPREAD else None


def _drift_check(run: Run, figures: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Each candidate's slowest / fastest round; a warning when the baseline's still exceeds
    :data:`DRIFT_SPREAD` after the re-measurement."""
    spread = {name: round_drift(f["latency_ms"]) for name, f in figures.items()}
    worst = _baseline_drift(figures)
    if worst is not None:
        base = _baseline_name(figures)
        rounds = figures[base]["latency_ms"]["per_round_p50"]
        msg = (
            f"machine speed drifted during the benchmark: {base} ran at {min(rounds):.2f}-"
            f"{max(rounds):.2f} ms p50 from round to round ({worst:.2f}x) over {len(rounds)} "
            "rounds, re-measurement included; ratios are paired by round, but a speed change "
            "inside a round still moves them: re-time on a steadier machine, or with more "
            "rounds (bench.rounds, bench/remeasure_run.py)"
        )
        run.warnings.append(msg)
        log.warning(msg)
    return {k: None if v is None else round(v, 3) for k, v in spread.items()}


def _load_check(run: Run, when: str) -> dict[str, float | None]:
    """Other work on the machine, sampled for a second (see :func:`measure.host.busy_cores`),
    and the 1-minute load average; a warning when other work takes half a core or more.

    Interleaving protects ratios from slow drifts, not from oversubscription: when more
    runnable threads than cores compete, multi-threaded kernels wait on each other and absolute
    figures (and even ratios) stop meaning much. The manifest says so rather than hiding it.
    """
    from ..measure.host import busy_cores

    other = busy_cores(1.0)
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    busy = other >= BUSY_CORES if other is not None else load > cores + 0.5
    if busy:
        what = f"other work used {other:.1f} cores" if other is not None else f"load {load:.1f}"
        msg = (
            f"machine busy {when} measuring ({what}, {cores} cores): latency figures are "
            "inflated and less reliable; measure on a quiet machine"
        )
        if msg not in run.warnings:
            run.warnings.append(msg)
        log.warning(msg)
    return {"other_cores": other, "load": round(load, 2)}


def profile_or_warn(run: Run) -> None:
    """The per-operator profile and weight statistics add to a run; their failure only warns."""
    try:
        _profile(run)
    except Exception as err:
        if is_user_error(err):
            raise
        msg = f"per-operator profile not recorded: {error_text(err)}"
        run.warnings.append(msg)
        log.warning(msg)


def _profile(run: Run) -> None:
    from ..measure.distributions import weight_stats
    from ..measure.opprofile import profile_ops

    sample = run.task.sample_inputs(1)
    targets = {
        c.name: c
        for c in [*run.chain, *run.alternatives]
        if c.onnx is not None and (c.name == "fp32-onnx" or c.accepted) and not has_failed(c)
    }
    selected = run.selected
    profiles = {}
    ov_profiles = {}
    for name in sorted({"fp32-onnx", selected.name} & set(targets)):
        path = targets[name].onnx
        assert path is not None
        if "onnxruntime" in run.runtimes and not is_ir(path):  # an IR runs on OpenVINO only
            profiles[name] = profile_ops(path, sample, run.threads)
        if "openvino" in run.runtimes:
            from ..measure.ov_profile import ov_profile_ops

            ov_profiles[name] = ov_profile_ops(path, sample, run.threads)
    run.extra["profiles"] = profiles
    if ov_profiles:
        run.extra["profiles_openvino"] = ov_profiles
    baseline = run.baseline.onnx
    assert baseline is not None
    run.extra["weight_distributions"] = weight_stats(baseline)


def profile_memory(run: Run) -> None:
    """With a memory budget in the target: the runtime setting of the selected candidate, chosen
    by measured peak RSS at the bench's batch sizes (``manifest.memory_profile``; serve uses it).
    A budget nothing fits stops the run with the smallest peak measured."""
    budget = run.recipe.target.memory_mb
    if budget is None:
        return
    from ..edge.memory import MemoryBudgetError, memory_profile

    selected = run.selected
    assert selected.onnx is not None
    if is_ir(selected.onnx):  # the profile measures ONNX Runtime settings, which an IR has none of
        run.warnings.append(
            f"memory budget not profiled: {selected.name} is an OpenVINO IR, and the memory "
            "profile measures ONNX Runtime's settings"
        )
        return
    sig = run.task.signature
    sizes = [1] if sig is not None and sig.max_batch == 1 else run.recipe.bench.batch_sizes
    try:
        profile = memory_profile(selected.onnx, run.task.sample_inputs, sizes, run.threads, budget)
    except MemoryBudgetError as err:
        run.extra["memory_profile"] = {**(err.profile or {}), "candidate": selected.name}
        raise
    run.extra["memory_profile"] = {**profile, "candidate": selected.name}
