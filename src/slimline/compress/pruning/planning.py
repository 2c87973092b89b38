"""Planning a prune step's width: which units matter (importance), the sensitivity map (each
group pruned alone at several ratios, cached in the step cache) and the plan it gives."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...candidate import Candidate
from ...context import StepContext
from ...errors import RecipeError
from ...task import Task
from ..finetune import Batches, accumulate_gradients
from .config import PruneConfig
from .graph import CostModel, PruneGraph
from .planner import Plan, check_reachable, make_plan, plan_from_ratios
from .sensitivity import Evaluator, SweepSpec, run_sweep, table_losses
from .state import RoundState

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import nn

__all__ = ["SWEEP_KIND", "sweep_key", "unit_importance", "width_plan"]

log = logging.getLogger("slimline.prune")
SWEEP_KIND = "prune-sweep"  # the sensitivity tables' entries in the step cache

_SWEEP_KEYS = (
    "ratios",
    "max_ratio",
    "round_to",
    "keep_first_last",
    "exclude",
    "importance",
    "taylor_batches",
    "sensitivity_samples",
)


def sweep_key(
    cfg: PruneConfig, cand: Candidate, ctx: StepContext, depth: dict[str, Any] | None = None
) -> str:
    """Key of the sensitivity table of this model and sweep setting in the step cache, so that
    a run with another target, plan or fine-tuning setting reuses it."""
    conf = {k: getattr(cfg, k) for k in _SWEEP_KEYS}
    conf["data"] = cfg.finetune.data  # decides Taylor vs magnitude ranking
    if depth is not None:  # the layers dropped first (and their recovery) shape the table
        conf["depth"] = {"entry": depth, "finetune": cfg.finetune.key_dict()}
    return ctx.cache_key(cfg, cand, sweep=conf)


def unit_importance(
    cfg: PruneConfig,
    ctx: StepContext,
    model: nn.Module,
    teacher: nn.Module,
    data: Batches,
    source: str,
) -> tuple[Any, str]:
    import torch_pruning as tp

    magnitude = tp.importance.GroupMagnitudeImportance(p=2)
    if cfg.importance == "magnitude" or (cfg.importance == "auto" and source != "train"):
        return magnitude, "magnitude-l2"
    used = accumulate_gradients(
        model, teacher, data, cfg.taylor_batches, output_kind=ctx.task.output_kind, task=ctx.task
    )
    if used == 0:
        if cfg.importance == "taylor":
            raise RecipeError(
                "Taylor importance needs a gradient signal: labelled training data or logit "
                "outputs; set `importance: magnitude` for this task"
            )
        return magnitude, "magnitude-l2 (the data gives no gradient signal)"
    return tp.importance.GroupTaylorImportance(), "taylor"


def _loadable(task: Task) -> bool:
    """Whether worker processes can load ``task`` again from its source."""
    if task.source.endswith(".py"):
        return Path(task.source).is_file()
    try:
        from ...examples import EXAMPLES
    except ImportError:
        return False
    return task.source in EXAMPLES


def _sweep(
    cfg: PruneConfig,
    ctx: StepContext,
    graph: PruneGraph,
    order: dict[str, list[int]],
    base_history: list[Any],
) -> dict[str, Any]:
    import torch

    example_np = ctx.task.sample_inputs(cfg.example_batch)
    evaluator = Evaluator(graph.model, ctx.task, cfg.sensitivity_samples, graph.example)
    spec = None
    workers = cfg.workers or ctx.threads
    if (workers > 1 or cfg.ray_address) and _loadable(ctx.task):
        buf = io.BytesIO()
        torch.save(graph.model.state_dict(), buf)
        spec = SweepSpec(
            ctx.task.source,
            ctx.recipe.samples,
            base_history,
            buf.getvalue(),
            cfg.sensitivity_samples,
            1,
            example_np,
        )
    elif workers > 1:
        ctx.warn(
            f"task {ctx.task.name} cannot be reloaded by worker processes; the sensitivity sweep runs in-process"
        )
    return run_sweep(
        graph,
        order,
        evaluator,
        ratios=cfg.ratios,
        max_ratio=cfg.max_ratio,
        spec=spec,
        workers=workers,
        ray_address=cfg.ray_address,
        progress=cfg.progress,
    )


def width_plan(
    cfg: PruneConfig,
    ctx: StepContext,
    graph: PruneGraph,
    cost: CostModel,
    importance: Callable[[], Any],
    state: RoundState,
    sweep_key: str,
    base_history: list[Any],
) -> tuple[Plan, dict[str, Any] | None]:
    if cfg.plan is not None:
        plan = plan_from_ratios(
            graph.groups, cfg.plan, cost, by=cfg.by, max_ratio=cfg.max_ratio, round_to=cfg.round_to
        )
        return plan, None
    check_reachable(
        cost,
        graph.groups,
        target=cfg.target,
        by=cfg.by,
        max_ratio=cfg.max_ratio,
        round_to=cfg.round_to,
    )
    table = state.data.get("sensitivity")
    cache = ctx.step_cache()
    if table is None:
        table = cache.get_json(SWEEP_KIND, sweep_key)
        if table is not None:
            table["reused"] = sweep_key
            log.info("sensitivity map: reusing %s", sweep_key)
    if table is None:
        imp = importance()
        order = {n: graph.removal_order(n, imp) for n in graph.groups}
        graph.model.zero_grad(set_to_none=True)
        table = _sweep(cfg, ctx, graph, order, base_history)
        cache.put_json(SWEEP_KIND, sweep_key, table)
        state.save(sensitivity=table)
        log.info(
            "sensitivity map: %d jobs in %.1fs (estimated %ss; %s)",
            table["jobs"],
            table["seconds"],
            table["estimate"]["seconds"],
            table["backend"],
        )
    plan = make_plan(
        graph.groups,
        table,
        table_losses(table, cfg.fidelity_weight),
        cost,
        target=cfg.target,
        by=cfg.by,
        max_ratio=cfg.max_ratio,
    )
    return plan, table
