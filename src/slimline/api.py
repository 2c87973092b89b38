"""The library's public surface for scripts and tests: a step context for a task, and export,
quantize and evaluate through the registered steps, measured the way the pipeline measures.

    from slimline import api, load_task, recipe_from_dict

    task = load_task("mnist")
    recipe = recipe_from_dict({"name": "mine", "task": "mnist"})
    ctx = api.context_for(task, recipe, Path("work"))      # FP32 baseline: the verified export
    int8 = api.quantize(ctx, ctx.baseline, QuantizeConfig(mode="dynamic"))
    print(api.evaluate(ctx, int8).metric)

A context's ``evaluate`` and ``compare`` default to the pipeline's own measurement (the recipe's
threads, ``bench`` settings and ``eval_limit``); pass functions to measure otherwise, or
``timed=False`` for a context without a benchmark (steps then skip their optional timings).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .candidate import Candidate
from .compress.quant.config import QuantizeConfig
from .config import StepConfig
from .context import Compare, Evaluate, StepContext
from .export import ExportConfig
from .measure.quality import Quality
from .pipeline import recipe_task, start_run, step_context
from .recipe import Recipe
from .steps import handler_for
from .task import Task

__all__ = ["context_for", "evaluate", "export", "quantize", "recipe_task", "run_step"]


def context_for(
    task: Task,
    recipe: Recipe,
    workdir: Path,
    *,
    baseline: Candidate | None = None,
    evaluate: Evaluate | None = None,
    compare: Compare | None = None,
    timed: bool = True,
    cache: Path | None = None,
) -> StepContext:
    """The context the pipeline gives a step of ``recipe`` on ``task``, writing into ``workdir``.

    The baseline is the task's verified export (the recipe's ``export`` settings, cached in
    ``cache``, default ``$SLIMLINE_CACHE``), its ONNX file for an ONNX task, or ``baseline``.
    The reference outputs are the task's FP32 model's (the baseline's when the task has no
    torch model). ``evaluate`` and ``compare`` replace the pipeline's measurement.
    """
    workdir = Path(workdir)
    run = start_run(recipe, task, workdir, cache=cache, baseline=baseline)
    ctx = step_context(run, workdir)
    if evaluate is not None:
        ctx.evaluate_fn = evaluate
    if compare is not None:
        ctx.compare_fn = compare
        ctx.compare_retiring_fn = None  # the caller's benchmark times every round
    if not timed:
        ctx.compare_fn = ctx.compare_retiring_fn = None
    return ctx


def run_step(
    ctx: StepContext, cfg: StepConfig, cand: Candidate, workdir: Path | None = None
) -> Candidate:
    """Run the step registered for ``cfg`` on ``cand``, writing into ``workdir`` (default
    ``ctx.workdir / cfg.kind``). Warnings and rejected alternatives go to ``ctx``'s lists."""
    where = Path(workdir) if workdir is not None else ctx.workdir / cfg.kind
    where.mkdir(parents=True, exist_ok=True)
    fitted = replace(ctx, workdir=where).for_candidate(cand)
    out = handler_for(cfg)(cfg, cand, fitted)
    fitted.keep_frozen([out, *fitted.alternatives])
    return out


def export(
    ctx: StepContext,
    module: object,
    *,
    config: ExportConfig | None = None,
    workdir: Path | None = None,
    name: str = "fp32-torch",
) -> Candidate:
    """Export ``module`` to ONNX with the export step (every output verified against PyTorch),
    with ``config`` or the recipe's ``export`` settings (opset, tolerances)."""
    cfg = config or ctx.recipe.step_config(ExportConfig)
    return run_step(ctx, cfg, Candidate(name, "torch", None, module=module), workdir)


def quantize(
    ctx: StepContext,
    cand: Candidate,
    config: QuantizeConfig | None = None,
    *,
    workdir: Path | None = None,
) -> Candidate:
    """Quantize ``cand`` (an ONNX candidate) with the quantize step: ``config``, or the
    recipe's ``quantize`` settings, or the step's defaults."""
    cfg = config or ctx.recipe.step_config(QuantizeConfig)
    return run_step(ctx, cfg, cand, workdir)


def evaluate(ctx: StepContext, cand: Candidate) -> Quality:
    """Task metric and fidelity of ``cand`` against the context's FP32 reference outputs."""
    return ctx.evaluate(cand)
