"""Run a recipe: baselines, steps (cached by content hash), accept/reject, measure, record.

Order of work:

1. load the task, hash its model and data, build the FP32 baselines (``fp32-torch`` and its
   export ``fp32-onnx``) and the FP32 reference outputs on the evaluation data;
2. run each step on the last accepted candidate. Its output is cached under a key that hashes its
   inputs; a rerun (or a resumed run) reuses it. The new candidate is kept only if it meets the
   budget AND is measurably faster (or smaller, when the objective is size) than its parent;
   otherwise it is recorded as rejected with the measured reason and the next step starts from
   the parent. A step that fails (an exporter, a pruning library, the quantizer), or whose
   output fails its check (``onnx.checker`` plus an ONNX Runtime load), evaluation or timing, is
   recorded the same way, rejected with the error as its reason; only an error in the user's
   input (:func:`errors.is_user_error`) stops the run at once;
3. measure every candidate of the chain interleaved (latency, throughput, RSS, size, metric,
   fidelity) and write the manifest, the artifacts and the report, atomically. When nothing
   can run any more (no FP32 baseline), the run stops with the manifest (status ``failed``,
   the reason) and the report written, and raises.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .cache import StepCache
from .candidate import (
    Candidate,
    artifact_files,
    artifact_hash,
    artifact_size,
    file_hash,
    is_ir,
    module_hash,
)
from .context import StepContext, step_key_parts
from .errors import RecipeError, SlimlineError, StepError, error_text, is_user_error
from .export import ExportConfig
from .measure.latency import (
    DRIFT_SPREAD,
    Until,
    benchmark,
    cannot_be_faster,
    pool_rounds,
    round_drift,
    speed_verdict,
)
from .measure.memory import peak_rss
from .measure.quality import Quality, Reference, evaluate, make_reference
from .measure.runners import check_candidate, make_runner
from .module_guard import eval_module
from .paths import cache_dir
from .recipe import BenchConfig, Recipe, StepConfig
from .record import (
    MANIFEST_SCHEMA,
    atomic_copy,
    atomic_write_json,
    data_hash,
    hardware,
    json_hash,
    now_iso,
    package_versions,
    versions,
)
from .runtimes import runtime_record, runtimes_for
from .steps import check_order, handler_for, restorer_for, spec_for, start_forms
from .task import Task, load_task

__all__ = ["Run", "run_recipe", "start_run", "step_context"]

log = logging.getLogger("slimline.pipeline")
BUSY_CORES = 0.5  # other work using this much CPU during a measurement makes it unreliable
# bump when how candidates are measured or judged changes: cached figures and decisions miss
MEASURE_VERSION = 1
MEASURE_PACKAGES = ("onnxruntime", "torch", "numpy", "openvino")


@dataclass
class Run:
    recipe: Recipe
    task: Task
    out: Path
    cache: StepCache
    remeasure: bool = False
    hashes: dict[str, str] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=versions)
    chain: list[Candidate] = field(default_factory=list)
    alternatives: list[Candidate] = field(default_factory=list)
    failed: dict[str, Any] | None = None
    reference: Reference | None = None
    warnings: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # profiles, distributions, step records
    started: float = field(default_factory=time.time)
    # the runtimes every candidate is measured on: the target's, or both for runtime auto
    runtimes: list[str] = field(default_factory=lambda: ["onnxruntime"])
    # metric and fidelity of each ONNX file on each runtime, measured once per run: a step's
    # search, its accept/reject verdict and the final figures read the same evaluation
    qualities: dict[tuple[str, str], Quality] = field(default_factory=dict)

    @property
    def serving_runtime(self) -> str:
        """The runtime the selected candidate is served on: the pick's with runtime auto."""
        pick = self.extra.get("runtime_pick") or {}
        return str(pick.get("runtime") or self.runtimes[0])

    @property
    def threads(self) -> int:
        return self.recipe.target.threads

    @property
    def current(self) -> Candidate:
        """The last accepted candidate: the input of the next step."""
        return next(c for c in reversed(self.chain) if c.accepted)

    @property
    def baseline(self) -> Candidate:
        return next(c for c in self.chain if c.name == "fp32-onnx")


def default_out_dir(recipe: Recipe) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{recipe.name}-{stamp}-{json_hash(recipe.to_dict())[7:15]}"


def run_recipe(
    recipe: Recipe, out: Path | None = None, *, cache: Path | None = None, remeasure: bool = False
) -> Run:
    """Run ``recipe`` end to end; returns the finished :class:`Run` (manifest already written)."""
    from .report.html import write_report  # late: report sections import optional modules

    task = load_task(
        recipe.task,
        recipe.samples,
        recipe.eval_samples,
        batch_axes=recipe.batch_axes(),
        primary_output=recipe.primary_output,
        outputs=recipe.outputs,
        metric=recipe.metric,
    )
    problem = check_order(recipe.steps, start_forms(task.is_onnx))
    if problem:  # the recipe checked the task's file name; this checks what it loaded
        raise RecipeError(f"recipe {recipe.name}: {problem}")
    run = Run(
        recipe=recipe,
        task=task,
        out=Path(out or default_out_dir(recipe)),
        cache=StepCache(cache or cache_dir()),
        remeasure=remeasure,
        runtimes=runtimes_for(recipe.target.runtime),
    )
    run.out.mkdir(parents=True, exist_ok=True)
    try:
        _baselines(run)
        write_manifest(run, "running")
        for cfg in _steps_after_export(recipe):
            _run_step(run, cfg)
            write_manifest(run, "running")
        _measure_all(run)
        with _timed("per-operator profile", run):
            _profile_or_warn(run)
        with _timed("memory profile", run):
            _memory_profile(run)
    except Exception as err:
        stopped = _stop(run, err)
        if stopped is err:
            raise
        raise stopped from err
    write_manifest(run, "complete")
    write_report(run.out)
    return run


def _stop(run: Run, err: Exception) -> SlimlineError:
    """Nothing after ``err`` can run: record what was done (status failed, the reason) and the
    report, and return the one-line error to raise. An error that is not slimline's own comes
    back as a :class:`StepError` (its traceback is logged at debug level)."""
    from .report.html import write_report

    if not isinstance(err, SlimlineError):
        log.debug("run stopped by an unexpected error", exc_info=err)
        err = StepError(f"the run stopped: {error_text(err)}")
    run.failed = {"error": str(err), "type": type(err).__name__, "user_error": err.user_error}
    write_manifest(run, "failed")
    try:
        write_report(run.out)
    except Exception as report_err:  # a report of a run that stopped early is a bonus
        log.warning("report of the failed run not written: %s", error_text(report_err))
    log.error("run failed; manifest and report: %s", run.out)
    return err


def _profile_or_warn(run: Run) -> None:
    """The per-operator profile and weight statistics add to a run; their failure only warns."""
    try:
        _profile(run)
    except Exception as err:
        if is_user_error(err):
            raise
        msg = f"per-operator profile not recorded: {error_text(err)}"
        run.warnings.append(msg)
        log.warning(msg)


def _steps_after_export(recipe: Recipe) -> list[StepConfig]:
    return [s for s in recipe.steps if not isinstance(s, ExportConfig)]


# ---------------------------------------------------------------------------------------------
# baselines


def _baselines(run: Run) -> None:
    task = run.task
    with _timed("hashing data", run):
        run.hashes["calibration_data"] = data_hash(task.calibration_data())
        run.hashes["eval_data"] = data_hash(task.eval_data())
    if task.is_onnx:
        assert task.onnx_path is not None
        run.hashes["model"] = file_hash(task.onnx_path)
        fp32 = Candidate(
            "fp32-onnx", "fp32", None, onnx=task.onnx_path, accepted=True, reason="baseline"
        )
        run.chain.append(fp32)
        run.reference = _reference(run, fp32)
        return
    assert task.model is not None
    # model() may return the same object every call: it is run, never changed (an eval-mode
    # copy when it comes in training mode), and every step copies before changing a module
    module = eval_module(task.model())
    run.hashes["model"] = module_hash(module)
    torch_cand = Candidate(
        "fp32-torch", "fp32", None, module=module, accepted=True, reason="baseline"
    )
    run.chain.append(torch_cand)
    run.reference = _reference(run, torch_cand)
    onnx_cand = _cached_step(run, run.recipe.step_config(ExportConfig), torch_cand)
    onnx_cand.accepted, onnx_cand.reason = True, "baseline (verified export)"
    run.chain.append(onnx_cand)


def start_run(
    recipe: Recipe,
    task: Task,
    out: Path,
    *,
    cache: Path | None = None,
    baseline: Candidate | None = None,
) -> Run:
    """A run up to its first step, for library use (:mod:`slimline.api`): the task's data
    hashes, the FP32 baselines and the FP32 reference outputs. With ``baseline`` that candidate
    is the baseline instead of the task's verified export; the reference outputs are still the
    task's own model's where it has one."""
    run = Run(
        recipe=recipe,
        task=task,
        out=Path(out),
        cache=StepCache(cache or cache_dir()),
        runtimes=runtimes_for(recipe.target.runtime),
    )
    run.out.mkdir(parents=True, exist_ok=True)
    if baseline is None:
        _baselines(run)
        return run
    run.hashes["calibration_data"] = data_hash(task.calibration_data())
    run.hashes["eval_data"] = data_hash(task.eval_data())
    baseline = replace(baseline, accepted=True, reason="baseline")  # the caller's stays as it is
    run.chain.append(baseline)
    fp32 = baseline
    if baseline.module is None and task.model is not None:
        fp32 = Candidate("fp32-torch", "fp32", None, module=task.model())
    run.reference = _reference(run, fp32)
    return run


def _reference(run: Run, cand: Candidate) -> Reference:
    with _timed("FP32 reference outputs", run):
        runner = make_runner(cand, run.threads, run.task.signature)
        return make_reference(runner, run.task, run.recipe.bench.eval_limit)


# ---------------------------------------------------------------------------------------------
# steps


def _step_key(run: Run, cfg: StepConfig, cand: Candidate) -> str:
    """The step's config, its input's content hash, the task's data, the recipe fields the step
    reads, its own version and its packages' versions (:func:`context.step_key_parts`)."""
    parts = step_key_parts(cfg, cand.content_hash(), run.task, run.hashes, run.recipe)
    return json_hash({**parts, "config": cfg.key_dict()})


def _context(run: Run, workdir: Path) -> StepContext:
    assert run.reference is not None
    baseline = next((c for c in run.chain if c.name == "fp32-onnx"), run.chain[0])
    return StepContext(
        task=run.task,
        recipe=run.recipe,
        workdir=workdir,
        baseline=baseline,
        reference=run.reference,
        cache=run.cache,
        data_hashes=run.hashes,
        evaluate_fn=lambda c: _quality(run, c),
        compare_fn=lambda cs: _compare(run, cs),
        evaluate_rows_fn=lambda c, rows: _quality_rows(run, c, rows),
    )


def step_context(run: Run, workdir: Path) -> StepContext:
    """The context the pipeline gives a step of ``run`` that writes into ``workdir``."""
    return _context(run, workdir)


def _cached_step(run: Run, cfg: StepConfig, cand: Candidate) -> Candidate:
    key = _step_key(run, cfg, cand)
    entry = run.cache.step_dir(key)
    if entry is None:
        log.info("step %s: running", cfg.kind)
        with _timed(f"step {cfg.kind}", run):
            entry = run.cache.build_step(key, lambda tmp: _execute(run, cfg, cand, tmp))
    else:
        log.info("step %s: reusing cached result %s", cfg.kind, entry.name)
    return _load_entry(run, cfg, cand, entry)


def _execute(run: Run, cfg: StepConfig, cand: Candidate, workdir: Path) -> dict[str, Any]:
    ctx = _context(run, workdir)
    try:
        out = handler_for(cfg)(cfg, cand, ctx)
    except Exception as err:
        if is_user_error(err):
            raise
        details = err.details if isinstance(err, StepError) else {}
        kind = type(err) if isinstance(err, StepError) else StepError  # ExportError stays one
        raise kind(
            f"step {cfg.kind} failed on {cand.name}: {error_text(err)}",
            details={**details, "warnings": ctx.warnings},
        ) from err
    return {
        "chosen": _cand_record(out, workdir),
        "warnings": ctx.warnings,
        "alternatives": [_cand_record(c, workdir) for c in ctx.alternatives],
    }


def _cand_record(c: Candidate, workdir: Path) -> dict[str, Any]:
    rel = None
    if c.onnx is not None:
        path = Path(c.onnx).resolve()
        if workdir.resolve() not in path.parents:
            raise StepError(f"step {c.step} returned {path}, outside its work directory")
        rel = str(path.relative_to(workdir.resolve()))
    return {
        "name": c.name,
        "step": c.step,
        "parent": c.parent,
        "onnx": rel,
        "meta": c.meta,
        "accepted": c.accepted,
        "reason": c.reason,
        "measurement": c.measurement,
    }


def _from_record(rec: dict[str, Any], entry: Path) -> Candidate:
    return Candidate(
        name=rec["name"],
        step=rec["step"],
        parent=rec["parent"],
        onnx=entry / rec["onnx"] if rec["onnx"] else None,
        meta=rec["meta"],
        accepted=rec["accepted"],
        reason=rec["reason"],
        measurement=rec["measurement"],
    )


def _load_entry(run: Run, cfg: StepConfig, parent: Candidate, entry: Path) -> Candidate:
    import json

    result = json.loads((entry / "result.json").read_text())
    chosen = _from_record(result["chosen"], entry)
    restore = restorer_for(cfg)
    chosen.module = restore(entry, chosen.meta, run.task) if restore else parent.module
    for w in result.get("warnings", []):
        if w not in run.warnings:
            run.warnings.append(w)
    for rec in result.get("alternatives", []):
        run.alternatives.append(_from_record(rec, entry))
    return chosen


def _unique_name(run: Run, name: str) -> str:
    taken = {c.name for c in [*run.chain, *run.alternatives]}
    if name not in taken:
        return name
    i = 2
    while f"{name}-{i}" in taken:
        i += 1
    return f"{name}-{i}"


def _run_step(run: Run, cfg: StepConfig) -> None:
    parent = run.current
    n_alt = len(run.alternatives)
    try:
        cand = _cached_step(run, cfg, parent)
    except Exception as err:
        if is_user_error(err):
            raise
        _reject_failed_step(run, cfg, parent, err)
        return
    cand.name, cand.parent = _unique_name(run, cand.name), parent.name
    for alt in run.alternatives[n_alt:]:
        alt.name = _unique_name(run, alt.name) if alt.name == cand.name else alt.name
    try:
        if cand.onnx is not None and "onnxruntime" in run.runtimes:
            check_candidate(cand.onnx, run.threads)
        cand.accepted, cand.reason = _decide(run, cfg, parent, cand)
    except Exception as err:
        if is_user_error(err):
            raise
        cand.accepted, cand.reason = False, f"failed: {error_text(err)}"
        cand.meta = {**cand.meta, "failure": _failure_record(err)}
    log.info("step %s: %s (%s)", cfg.kind, "ACCEPTED" if cand.accepted else "REJECTED", cand.reason)
    rivals = [a for a in run.alternatives[n_alt:] if a.meta.get("competes")]
    run.chain.append(_compete(run, cfg, parent, cand, rivals))


def _compete(
    run: Run, cfg: StepConfig, parent: Candidate, cand: Candidate, rivals: list[Candidate]
) -> Candidate:
    """Judge each rival the step built (an alternative marked ``competes``: NNCF's INT8 model)
    against the same parent, on the same budget, like the chosen candidate. With one runtime
    an accepted rival that is faster than the chosen one in a direct interleaved comparison
    takes its place in the chain; with runtime auto every accepted rival is measured on both
    runtimes and can be the pick. Returns the step's candidate for the chain."""
    for rival in rivals:
        try:
            if rival.onnx is not None and "onnxruntime" in run.runtimes:
                check_candidate(rival.onnx, run.threads)
            rival.accepted, rival.reason = _decide(run, cfg, parent, rival)
        except Exception as err:
            if is_user_error(err):
                raise
            rival.accepted, rival.reason = False, f"failed: {error_text(err)}"
        log.info("step %s rival %s: %s (%s)", cfg.kind, rival.name, rival.accepted, rival.reason)
        if len(run.runtimes) == 1 and rival.accepted and _beats(run, rival, cand):
            run.alternatives[run.alternatives.index(rival)] = cand
            cand.meta = {**cand.meta, "replaced_by": rival.name}
            cand = rival
    return cand


def _beats(run: Run, rival: Candidate, cand: Candidate) -> bool:
    """``rival`` is faster than ``cand`` (or ``cand`` was rejected), measured interleaved."""
    if not cand.accepted:
        return True
    lat = _compare(run, [cand, rival])
    return bool(lat[rival.name]["latency_ms"]["p50"] < lat[cand.name]["latency_ms"]["p50"])


def _reject_failed_step(run: Run, cfg: StepConfig, parent: Candidate, err: Exception) -> None:
    """A step that failed as a whole: a rejected entry with the error as its reason (nothing to
    run or measure); the next step starts from ``parent``."""
    reason = f"failed: {error_text(err)}"
    failure = _failure_record(err)
    for w in failure.pop("warnings", []):
        if w not in run.warnings:
            run.warnings.append(w)
    cand = Candidate(
        name=_unique_name(run, cfg.kind),
        step=cfg.kind,
        parent=parent.name,
        accepted=False,
        reason=reason,
        meta={"failure": failure},
    )
    run.chain.append(cand)
    msg = f"step {cfg.kind} rejected: {reason}; the run goes on from {parent.name}"
    run.warnings.append(msg)
    log.warning(msg)


def _failure_record(err: Exception) -> dict[str, Any]:
    details = err.details if isinstance(err, StepError) else {}
    return {"type": type(err).__name__, "error": error_text(err), **details}


def _failed(c: Candidate) -> bool:
    """A candidate whose step, check, evaluation or timing failed: recorded, never measured."""
    return "failure" in c.meta


def _decide(run: Run, cfg: StepConfig, parent: Candidate, cand: Candidate) -> tuple[bool, str]:
    key = json_hash(
        {
            "decide": _step_key(run, cfg, parent),
            "cand": cand.content_hash(),
            "parent": parent.content_hash(),
            **_measure_key_parts(run),
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
        with _timed(f"judge {cand.name} on {run.runtimes[0]}", run):
            ok, why = _judge(run, parent, cand, run.runtimes[0])
        return {run.runtimes[0]: {"accepted": ok, "reason": why}}
    verdicts: dict[str, dict[str, Any]] = {}
    for rt in run.runtimes:
        timing: dict[str, Any] = {}
        try:
            with _timed(f"judge {cand.name} on {rt}", run):
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
    ctx = _context(run, run.out)
    quality = _quality(run, cand, runtime)
    ok, budget_reason = ctx.within_budget(quality)
    if not ok:
        return False, budget_reason
    b = run.recipe.budget
    if b.objective == "size":
        return _judge_size(parent, cand, b.min_gain, budget_reason)
    lat = _compare(run, [parent, cand], runtime=runtime, until=_settled_slower(run, parent, cand))
    p, c = lat[parent.name]["latency_ms"], lat[cand.name]["latency_ms"]
    verdict, pair = speed_verdict(p, c, b.min_gain)
    if verdict == "inconclusive":
        # Enough gain at the median, but the rounds disagree: a drifting machine, not an answer.
        # Measure again with twice the rounds and decide on all of them, paired by round.
        log.info(
            "step %s: speed vs %s inconclusive (%s); measuring again",
            cand.name,
            parent.name,
            _pair_text(pair),
        )
        again = _compare(run, [parent, cand], rounds=2 * run.recipe.bench.rounds, runtime=runtime)
        p = pool_rounds(p, again[parent.name]["latency_ms"])
        c = pool_rounds(c, again[cand.name]["latency_ms"])
        lat = again
        verdict, pair = speed_verdict(p, c, b.min_gain)
    ratio = c["p50"] / p["p50"]
    if timing is not None:
        timing.update(_timing_record(parent.name, p, c, pair))
    pc, cc = lat[parent.name]["cpu_ms"]["p50"], lat[cand.name]["cpu_ms"]["p50"]
    figures = (
        f"p50 {c['p50']:.3f} ms vs {p['p50']:.3f} ms ({ratio:.2f}x of {parent.name}; "
        f"CPU time {cc / pc:.2f}x; {_pair_text(pair)})"
    )
    if verdict != "faster":
        why = "slower than" if pair["ratio"] > 1.0 else "not measurably faster than"
        planned = run.recipe.bench.rounds
        if pair["rounds"] < planned:
            figures += (
                f"; stopped after {pair['rounds']} of {planned} rounds: it missed the "
                f"{b.min_gain:.0%} gain in more than half of them, which no later round changes"
            )
        return False, f"{why} {parent.name}: {figures}; {budget_reason}"
    if b.p99_ms is not None and c["p99"] > b.p99_ms:
        run.warnings.append(f"{cand.name}: p99 {c['p99']:.2f} ms is above the target {b.p99_ms} ms")
    return True, f"faster: {figures}; {budget_reason}"


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
    return (
        f"faster in {pair['faster_rounds']} of {pair['rounds']} interleaved rounds, "
        f"median per-round ratio {pair['ratio']:.2f}, sign test p={pair['p_value']:.3f}"
    )


def _judge_size(parent: Candidate, cand: Candidate, min_gain: float, why: str) -> tuple[bool, str]:
    ps, cs = _size(parent), _size(cand)
    if ps is None or cs is None:
        return False, "size objective needs ONNX artifacts on both sides"
    ratio = cs / ps
    figures = f"{cs} vs {ps} bytes ({ratio:.2f}x of {parent.name})"
    if ratio > 1.0 - min_gain:
        return False, f"not measurably smaller: {figures}; {why}"
    return True, f"smaller: {figures}; {why}"


# ---------------------------------------------------------------------------------------------
# measurement


def _quality(run: Run, cand: Candidate, runtime: str | None = None) -> Quality:
    """Metric and fidelity of ``cand`` on ``runtime`` (default: the run's first runtime). An
    ONNX file is evaluated once per runtime in a run (the same file on the same runtime and
    data gives the same outputs); a failure is not kept, so it is raised again where asked."""
    assert run.reference is not None
    rt = runtime or run.runtimes[0]
    key = (cand.content_hash(), rt) if cand.onnx is not None else None
    if key is not None and key in run.qualities:
        return run.qualities[key]
    runner = make_runner(cand, run.threads, run.task.signature, rt)
    quality = evaluate(runner, run.task, run.reference, run.recipe.bench.eval_limit)
    if key is not None:
        run.qualities[key] = quality
    return quality


def _quality_rows(run: Run, cand: Candidate, rows: int) -> Quality | None:
    """Metric and fidelity of ``cand`` on the first ``rows`` evaluation rows, on the run's first
    runtime, against FP32's on those rows (:func:`~slimline.measure.screen.subset_reference`)."""
    from .measure.screen import subset_reference

    assert run.reference is not None
    ref = subset_reference(run.reference, run.task, rows)
    if ref is None:
        return None
    runner = make_runner(cand, run.threads, run.task.signature, run.runtimes[0])
    return evaluate(runner, run.task, ref, rows)


def _compare(
    run: Run,
    cands: list[Candidate],
    rounds: int | None = None,
    runtime: str | None = None,
    until: Until | None = None,
) -> dict[str, dict[str, Any]]:
    sample = run.task.sample_inputs(1)
    bench = run.recipe.bench
    return benchmark(
        cands,
        sample,
        bench.model_copy(update={"rounds": rounds}) if rounds else bench,
        run.threads,
        throughput=False,
        desc="compare " + " vs ".join(c.name for c in cands),
        signature=run.task.signature,
        runtimes=[runtime or run.runtimes[0]],
        until=until,
    )


def _settled_slower(run: Run, parent: Candidate, cand: Candidate) -> Until:
    """Stops a parent-vs-candidate comparison as soon as its verdict can only be ``not faster``
    (:func:`~slimline.measure.latency.cannot_be_faster`): a clear rejection costs about half
    the rounds, and every verdict stays what all the rounds would have given."""
    rounds, gain = run.recipe.bench.rounds, run.recipe.budget.min_gain

    def until(p50s: dict[str, list[float]]) -> bool:
        return cannot_be_faster(p50s[parent.name], p50s[cand.name], rounds, gain)

    return until


def _size(c: Candidate) -> int | None:
    return artifact_size(c.onnx) if c.onnx is not None else None


def _params(c: Candidate) -> int | None:
    if c.onnx is not None and is_ir(c.onnx):
        from .measure.ov import ov_param_count

        return ov_param_count(Path(c.onnx))
    if c.onnx is not None:
        import onnx

        model = onnx.load(str(c.onnx), load_external_data=False)
        return int(sum(int(np.prod(t.dims)) for t in model.graph.initializer))
    if c.module is not None:
        return int(sum(p.numel() for p in c.module.parameters()))
    return None


def _measure_key_parts(run: Run) -> dict[str, Any]:
    """What a measurement or an accept/reject decision depends on besides the models."""
    r = run.recipe
    return {
        "measure_version": MEASURE_VERSION,
        "packages": package_versions(MEASURE_PACKAGES),
        "target": r.target.key_dict(),
        "budget": r.budget.key_dict(),
        **({"judging": r.judging()} if r.outputs or r.metric else {}),
        "bench": r.bench.key_dict(),
    }


def _measure_all(run: Run) -> None:
    cands = [c for c in run.chain if not _failed(c)]
    if len(run.runtimes) > 1:  # rivals (NNCF): measured on both; the pick if accepted there
        cands += [a for a in run.alternatives if a.meta.get("competes") and not _failed(a)]
    # with several runtimes, which pairs are timed follows the verdicts: part of the key
    timed = {"timed": sorted(_pairs_to_time(run, cands))} if len(run.runtimes) > 1 else {}
    key = json_hash(
        {
            "measure": [c.content_hash() for c in cands],
            "names": [c.name for c in cands],
            "data": run.hashes,
            **_measure_key_parts(run),
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
        from .pick import apply_pick

        run.extra["runtime_pick"] = apply_pick(cands, run.runtimes)
    for alt in run.alternatives:
        alt.measurement = {**(alt.measurement or {}), "size_bytes": _size(alt)}


def _measure_fresh(run: Run, cands: list[Candidate]) -> dict[str, dict[str, Any]]:
    bench: BenchConfig = run.recipe.bench
    sample = run.task.sample_inputs(max(bench.batch_sizes))
    before = _load_check(run, "before")
    with _timed("final benchmark", run):
        figures = benchmark(
            cands,
            sample,
            bench,
            run.threads,
            desc="measure all candidates",
            signature=run.task.signature,
            runtimes=run.runtimes,
        )
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
    with _timed("final quality, size and peak RSS", run):
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
    q = _quality(run, c, runtime)
    f["metric"] = {"name": run.task.metric_name, "value": q.metric}
    f["fidelity"] = q.fidelity_dict()
    f["size_bytes"], f["params"] = _size(c), _params(c)
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
    from .runtimes import pair_name

    bench: BenchConfig = run.recipe.bench
    sample = run.task.sample_inputs(max(bench.batch_sizes))
    timed = _pairs_to_time(run, cands)
    before = _load_check(run, "before")
    with _timed("final benchmark", run):
        figures = benchmark(
            cands,
            sample,
            bench,
            run.threads,
            desc="measure all (runtime, candidate) pairs",
            signature=run.task.signature,
            runtimes=run.runtimes,
            pairs=timed,
        )
    after = _load_check(run, "after")
    spread = {k: round_drift(f["latency_ms"]) for k, f in figures.items() if "latency_ms" in f}
    _record_conditions(run, spread, before, after)
    rss_sample = _rss_sample(run, sample)
    ctx = _context(run, run.out)
    out: dict[str, dict[str, Any]] = {c.name: {"runtimes": {}} for c in cands}
    with _timed("final quality, size and peak RSS", run):
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
    from .pick import accepted_on
    from .runtimes import pair_name

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
            q = _quality(run, c, rt)  # evaluated by its verdict already: read, not run again
            f["metric"] = {"name": run.task.metric_name, "value": q.metric}
            f["fidelity"] = q.fidelity_dict()
            f["size_bytes"], f["params"] = _size(c), _params(c)
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
    from .measure.host import busy_cores

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


def _profile(run: Run) -> None:
    from .measure.distributions import weight_stats
    from .measure.opprofile import profile_ops

    sample = run.task.sample_inputs(1)
    targets = {
        c.name: c
        for c in [*run.chain, *run.alternatives]
        if c.onnx is not None and (c.name == "fp32-onnx" or c.accepted) and not _failed(c)
    }
    selected = _selected(run)
    profiles = {}
    ov_profiles = {}
    for name in sorted({"fp32-onnx", selected.name} & set(targets)):
        path = targets[name].onnx
        assert path is not None
        if "onnxruntime" in run.runtimes and not is_ir(path):  # an IR runs on OpenVINO only
            profiles[name] = profile_ops(path, sample, run.threads)
        if "openvino" in run.runtimes:
            from .measure.ov_profile import ov_profile_ops

            ov_profiles[name] = ov_profile_ops(path, sample, run.threads)
    run.extra["profiles"] = profiles
    if ov_profiles:
        run.extra["profiles_openvino"] = ov_profiles
    baseline = run.baseline.onnx
    assert baseline is not None
    run.extra["weight_distributions"] = weight_stats(baseline)


def _memory_profile(run: Run) -> None:
    """With a memory budget in the target: the runtime setting of the selected candidate, chosen
    by measured peak RSS at the bench's batch sizes (``manifest.memory_profile``; serve uses it).
    A budget nothing fits stops the run with the smallest peak measured."""
    budget = run.recipe.target.memory_mb
    if budget is None:
        return
    from .edge.memory import MemoryBudgetError, memory_profile

    selected = _selected(run)
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


# ---------------------------------------------------------------------------------------------
# manifest


def _selected(run: Run) -> Candidate:
    pick = run.extra.get("runtime_pick") or {}
    if pick.get("candidate"):
        return next(c for c in [*run.chain, *run.alternatives] if c.name == pick["candidate"])
    return next(
        (c for c in reversed(run.chain) if c.accepted and c.onnx is not None), run.chain[-1]
    )


def _entry(run: Run, c: Candidate) -> dict[str, Any]:
    artifact = None
    if c.onnx is not None:
        artifact = f"artifacts/{c.name}{'.xml' if is_ir(c.onnx) else '.onnx'}"
        dst = run.out / artifact
        if not dst.exists() or artifact_hash(dst) != c.content_hash():
            for src, to in zip(artifact_files(c.onnx), artifact_files(dst), strict=True):
                atomic_copy(src, to)
    m = c.measurement or {}
    return {
        "name": c.name,
        "step": c.step,
        "parent": c.parent,
        "accepted": bool(c.accepted),
        "reason": c.reason,
        "artifact": artifact,
        "runtime": None if _failed(c) and c.onnx is None else _served_on(run, c),
        **m,
        "meta": c.meta,
    }


def _served_on(run: Run, c: Candidate) -> str:
    """The runtime a candidate's top-level figures were measured on."""
    return run.serving_runtime if c.onnx is not None else c.runtime


def write_manifest(run: Run, status: str) -> None:
    task = run.task
    chain = [_entry(run, c) for c in run.chain]
    alts = [{**_entry(run, c), "alternative": True} for c in run.alternatives]
    manifest: dict[str, Any] = {
        "schema": MANIFEST_SCHEMA,
        "status": status,
        "recipe": run.recipe.to_dict(),
        "created": now_iso(),
        "wall_seconds": round(time.time() - run.started, 1),
        "task": {
            "name": task.name,
            "source": task.source,
            "metric_name": task.metric_name,
            "output_kind": task.output_kind,
            "inputs": _input_spec(run),
            "signature": task.signature.to_dict() if task.signature else None,
            "notes": task.notes,
        },
        "hashes": run.hashes,
        "versions": run.versions,
        "step_versions": {s.kind: spec_for(s).version for s in run.recipe.steps},
        "hardware": hardware(),
        "target": run.recipe.target.model_dump(),
        "runtimes": {rt: runtime_record(rt, run.threads) for rt in run.runtimes},
        "selected_runtime": run.serving_runtime if run.chain else None,
        "selected": _selected(run).name if run.chain else None,
        "reference_metric": run.reference.metric if run.reference else None,
        "candidates": chain + alts,
        "warnings": run.warnings,
        **run.extra,
    }
    if run.failed:
        manifest["failure"] = run.failed
    atomic_write_json(run.out / "manifest.json", manifest)


def _input_spec(run: Run) -> dict[str, Any]:
    path = next((c.onnx for c in run.chain if c.onnx is not None), None)
    if path is None:
        return {}
    from .measure.runners import ort_session, session_input_spec

    spec = session_input_spec(ort_session(path, 1, level="disable"))
    return {k: {"dtype": d, "shape": s} for k, (d, s) in spec.items()}


class _timed:
    """Logs how long ``what`` took; with ``run``, adds it to the manifest's ``phase_seconds``
    (summed over repeats: where a run's wall time went)."""

    def __init__(self, what: str, run: Run | None = None) -> None:
        self.what, self.run = what, run

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        took = time.perf_counter() - self.t0
        log.info("%s: %.1f s", self.what, took)
        if self.run is not None:
            phases = self.run.extra.setdefault("phase_seconds", {})
            phases[self.what] = round(phases.get(self.what, 0.0) + took, 2)
