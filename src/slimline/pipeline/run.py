"""Run a recipe end to end (:func:`run_recipe`), or up to its first step for library use
(:func:`start_run`).

Load the task, hash its model and data, build the FP32 baselines (``fp32-torch`` and its
verified export ``fp32-onnx``) and the FP32 reference outputs; run each step (:mod:`.step`,
which judges with :mod:`.judge`); measure the chain (:mod:`.final`); write the manifest
(:mod:`.manifest`) and the report. When nothing can run any more, the manifest (status
``failed``, the reason) and the report are written and the error is raised.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from ..cache import StepCache
from ..candidate import Candidate, file_hash, module_hash
from ..errors import RecipeError, SlimlineError, StepError, error_text
from ..export import ExportConfig
from ..measure.quality import Reference, make_reference
from ..measure.runners import make_runner
from ..module_guard import eval_module
from ..paths import cache_dir
from ..recipe import Recipe, StepConfig
from ..record import data_hash, json_hash
from ..runtimes import runtimes_for
from ..steps import check_order, start_forms
from ..task import Task, load_task
from .final import measure_all, profile_memory, profile_or_warn
from .manifest import write_manifest
from .state import Run, log, stopwatch
from .step import cached_step, run_step

__all__ = ["default_out_dir", "run_recipe", "start_run"]


def run_recipe(
    recipe: Recipe, out: Path | None = None, *, cache: Path | None = None, remeasure: bool = False
) -> Run:
    """Run ``recipe`` end to end; returns the finished :class:`Run` (manifest already written)."""
    from ..report.html import write_report  # late: report sections import optional modules

    task = recipe_task(recipe)
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
            run_step(run, cfg)
            write_manifest(run, "running")
        measure_all(run)
        with stopwatch("per-operator profile", run):
            profile_or_warn(run)
        with stopwatch("memory profile", run):
            profile_memory(run)
    except Exception as err:
        stopped = _stop(run, err)
        if stopped is err:
            raise
        raise stopped from err
    write_manifest(run, "complete")
    write_report(run.out)
    return run


def recipe_task(recipe: Recipe) -> Task:
    """The task a recipe names, with its data, batch axes, declared outputs and metric."""
    return load_task(
        recipe.task,
        recipe.samples,
        recipe.eval_samples,
        batch_axes=recipe.batch_axes(),
        primary_output=recipe.primary_output,
        outputs=recipe.outputs,
        metric=recipe.metric,
        constant_inputs=recipe.constant_inputs,
    )


def _stop(run: Run, err: Exception) -> SlimlineError:
    """Nothing after ``err`` can run: record what was done (status failed, the reason) and the
    report, and return the one-line error to raise. An error that is not slimline's own comes
    back as a :class:`StepError` (its traceback is logged at debug level)."""
    from ..report.html import write_report

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


def _steps_after_export(recipe: Recipe) -> list[StepConfig]:
    return [s for s in recipe.steps if not isinstance(s, ExportConfig)]


def _baselines(run: Run) -> None:
    task = run.task
    with stopwatch("hashing data", run):
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
    onnx_cand = cached_step(run, run.recipe.step_config(ExportConfig), torch_cand)
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
    with stopwatch("FP32 reference outputs", run):
        runner = make_runner(cand, run.threads, run.task.signature)
        return make_reference(runner, run.task, run.recipe.bench.eval_limit)


def default_out_dir(recipe: Recipe) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{recipe.name}-{stamp}-{json_hash(recipe.to_dict())[7:15]}"
