"""The ``prune`` step: sensitivity map -> plan -> rounds of pruning, each recovered by distillation.

The step returns the pruned dense model and its verified ONNX export; the pipeline accepts it only
if it is within budget and measurably faster. Progress is checkpointed after every round in a work
directory of the step cache (:meth:`StepCache.work_dir`, keyed like the step's own entry: input
model, config, data, step version, package versions; atomic writes), and inside a round at every
held-out evaluation of its recovery, so a killed run resumes where it was: inside the round being
recovered, or after the last finished round; the plan is kept there too, and the sensitivity
table is a JSON entry of the step cache that a run with another target or fine-tuning reuses.

This module is the step itself, read top-down from :func:`prune_step`; its parts live beside it:
:mod:`.config` (``PruneConfig``), :mod:`.layers` (the depth stage, ``layers:``),
:mod:`.planning` (importance, sensitivity map, plan), :mod:`.rounds` (prune + recover, round by
round) and :mod:`.state` (the checkpoints a killed run resumes from).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...candidate import Candidate
from ...context import StepContext
from ...errors import StepError
from ...export import ExportConfig, export_module, verify_export
from ...module_guard import private_copy, torch_threads
from ...record import atomic_write_json
from ...records import PruneRecord
from ...steps import Contract, step
from ...task import Task
from ..finetune import Batches, DistillHooks, resolve_data, to_tensors
from .config import PruneConfig
from .depth import replay_history
from .graph import CostModel, PruneGraph, count_macs_params
from .layers import check_depth, run_depth
from .planner import plan_from_ratios
from .planning import sweep_key, unit_importance, width_plan
from .rounds import run_rounds
from .state import RoundState, save_torch

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import Tensor, nn

__all__ = ["PruneConfig", "prune_step", "restore_pruned"]

HISTORY_ATTR = "_slimline_prune_history"  # pruning history carried by a pruned module
WEIGHTS_FILE = "pruned.pt"
HISTORY_FILE = "prune_history.json"


def _save_module(workdir: Path, module: nn.Module, history: list[Any]) -> dict[str, str]:
    save_torch(workdir / WEIGHTS_FILE, module.state_dict())
    atomic_write_json(workdir / HISTORY_FILE, history)
    return {"weights": WEIGHTS_FILE, "history_file": HISTORY_FILE}


def restore_pruned(entry: Path, meta: dict[str, Any], task: Task) -> nn.Module:
    """Rebuild the pruned module of a cached prune step: a copy of the task's model, the
    recorded channel removals re-applied, then the saved weights
    (``torch.load(weights_only=True)``). The task's own module is left as it was: ``model()``
    may return the same object every call, and it is the FP32 baseline."""
    import torch

    if task.model is None:
        raise StepError(f"task {task.name} has no model(); a cached prune step cannot be restored")
    history = json.loads((Path(entry) / meta["history_file"]).read_text())
    model: nn.Module = private_copy(task.model()).eval()
    replay_history(model, to_tensors(task.sample_inputs(2)), history)
    model.load_state_dict(torch.load(Path(entry) / meta["weights"], weights_only=True))
    setattr(model, HISTORY_ATTR, history)
    return model.eval()


def _state_dir(cfg: PruneConfig, cand: Candidate, ctx: StepContext) -> Path:
    return ctx.step_cache().work_dir(ctx.cache_key(cfg, cand, config=cfg.key_dict()))


def _export(ctx: StepContext, module: nn.Module) -> tuple[Path, dict[str, Any]]:
    cfg = ctx.recipe.step_config(ExportConfig)
    sample = ctx.task.sample_inputs(cfg.check_samples)
    path = export_module(module, sample, ctx.workdir / "model.onnx", cfg.opset)
    return path, verify_export(module, path, sample, cfg, ctx.threads)


def _torch_view(ctx: StepContext, teacher: nn.Module, pruned: nn.Module) -> dict[str, Any] | None:
    """Metric, fidelity and interleaved latency of the pruned model in PyTorch against the FP32
    PyTorch model: the PyTorch half of the report's four-way table."""
    if ctx.compare_fn is None:  # a context without a benchmark (library use, unit tests)
        return None
    quality = ctx.evaluate(Candidate("prune-torch", "prune", None, module=pruned))
    lat = ctx.compare(
        [
            Candidate("fp32-torch", "fp32", None, module=teacher),
            Candidate("prune-torch", "prune", None, module=pruned),
        ]
    )
    return {
        "metric": quality.metric,
        "fidelity": quality.fidelity_dict(),
        "latency_ms": lat["prune-torch"]["latency_ms"],
        "fp32_latency_ms": lat["fp32-torch"]["latency_ms"],
    }


def _input_module(cand: Candidate) -> nn.Module:
    if cand.module is None:
        raise StepError(
            f"prune needs a torch model, but candidate {cand.name} is an ONNX file only; give a "
            "task .py whose model() returns the torch.nn.Module"
        )
    module: nn.Module = cand.module
    return module


def _graph(cfg: PruneConfig, module: nn.Module, example: dict[str, Tensor]) -> PruneGraph:
    graph = PruneGraph(
        private_copy(module).eval(),  # Torch-Pruning changes the model in place
        example,
        exclude=cfg.exclude,
        keep_first_last=cfg.keep_first_last,
        round_to=cfg.round_to,
    )
    if not graph.groups:
        raise StepError(
            f"no prunable channel groups in {type(module).__name__} (skipped: "
            f"{graph.skipped or 'none'}); check `exclude` and `keep_first_last`, or lower `round_to`"
        )
    return graph


def _frozen(module: nn.Module) -> nn.Module:
    teacher: nn.Module = private_copy(module).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def _share(before: int, after: int) -> dict[str, Any]:
    return {"before": before, "after": after, "removed": 1 - after / before}


@step(
    PruneConfig,
    contract=Contract(consumes=("torch",), produces=("torch", "onnx")),
    version=2,  # 2: a model with several outputs is recovered on every one, not its first
    reads=("target.threads", "bench", "samples", "steps.export"),
    packages=("torch", "torch-pruning", "onnx", "onnxruntime", "numpy"),
    restore=restore_pruned,
)
def prune_step(cfg: PruneConfig, cand: Candidate, ctx: StepContext) -> Candidate:
    """Prune a copy of ``cand``'s module: the parent's module (and the task's) is left as it was."""
    with torch_threads(ctx.threads):
        return _prune(cfg, cand, ctx)


def _prune(cfg: PruneConfig, cand: Candidate, ctx: StepContext) -> Candidate:
    module = _input_module(cand)
    example = to_tensors(ctx.task.sample_inputs(cfg.example_batch))
    request = check_depth(cfg, module, example)  # a plan that cannot work fails before any work
    base_history = list(getattr(module, HISTORY_ATTR, []))
    teacher = _frozen(module)
    data, source, note = resolve_data(ctx.task, cfg.finetune)
    if note:
        ctx.warn(note)
    state = RoundState(_state_dir(cfg, cand, ctx))
    depth = None
    if request is not None:
        depth = run_depth(cfg, ctx, cand, module, teacher, data, state, example, request)
        base_history.append(depth.entry)
    if cfg.thins or (depth is not None and depth.width > 0):
        start = depth.model if depth is not None else module
        hooks = depth.hooks if depth is not None else None
        uniform = depth.width if depth is not None and depth.width > 0 else None
        pruned, width_meta = _width(
            cfg, ctx, cand, start, teacher, (data, source), state, base_history, hooks, uniform
        )
    else:
        assert depth is not None, "a step that does not thin drops layers"
        pruned, width_meta = depth.model, _no_width()
    pruned.eval()
    history = base_history + width_meta.pop("history")
    setattr(pruned, HISTORY_ATTR, history)
    files = _save_module(ctx.workdir, pruned, history)
    onnx_path, check = _export(ctx, pruned)
    macs_before, params_before = count_macs_params(teacher, example)
    macs_after, params_after = count_macs_params(pruned, example)
    meta: PruneRecord = {
        **width_meta,
        "layers": None if depth is None else depth.meta,
        "finetune_data": source,
        "macs": _share(macs_before, macs_after),
        "params": _share(params_before, params_after),
        "export_check": check,
        "torch": _torch_view(ctx, teacher, pruned),
        "weights": files["weights"],
        "history_file": files["history_file"],
    }
    state.clear()
    return Candidate("prune", "prune", cand.name, onnx=onnx_path, module=pruned, meta=dict(meta))


def _no_width() -> PruneRecord:
    return {"plan": {}, "planned": None, "groups": {}, "sensitivity": None, "rounds": [],
            "resumed_after_round": 0, "importance": [], "history": []}  # fmt: skip


def _width(
    cfg: PruneConfig,
    ctx: StepContext,
    cand: Candidate,
    start: nn.Module,
    teacher: nn.Module,
    data_source: tuple[Batches, str],
    state: RoundState,
    base_history: list[Any],
    hooks: DistillHooks | None,
    uniform: float | None = None,
) -> tuple[Any, PruneRecord]:
    """Heads, neurons and channels of ``start`` thinned to the plan (the planner's, or the
    same ``uniform`` share in every group, as a latency-priced option was timed), round by
    round."""
    data, source = data_source
    graph = _graph(cfg, start, to_tensors(ctx.task.sample_inputs(cfg.example_batch)))
    cost = CostModel(graph)
    depth = next((h for h in reversed(base_history) if isinstance(h, dict)), None)
    if uniform is not None:
        ratios = {n: min(uniform, cfg.max_ratio) for n in graph.groups}
        plan = plan_from_ratios(
            graph.groups, ratios, cost, by=cfg.by, max_ratio=cfg.max_ratio, round_to=cfg.round_to
        )
        table = None
    else:
        plan, table = width_plan(
            cfg,
            ctx,
            graph,
            cost,
            lambda: unit_importance(cfg, ctx, graph.model, teacher, data, source)[0],
            state,
            sweep_key(cfg, cand, ctx, depth),
            base_history,
        )
    state.save(plan=plan.to_dict())
    resumed = state.rounds_done
    records = run_rounds(cfg, ctx, graph, teacher, data, source, plan, state, hooks)
    return graph.model, {
        "plan": {n: r for n, r in plan.ratios.items() if r > 0},
        "planned": plan.to_dict(),
        "groups": {n: {**g.to_dict(), "kept": graph.units(n)} for n, g in graph.groups.items()},
        "skipped_groups": graph.skipped,
        "sensitivity": table,
        "rounds": records,
        "resumed_after_round": resumed,
        "importance": sorted({r["importance"] for r in records if "importance" in r}),
        "history": graph.history(),
    }
