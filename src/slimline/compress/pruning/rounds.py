"""A prune step's rounds: each prunes a share of the plan and recovers by distillation from the
unpruned teacher, checkpointed so that a killed run resumes inside the round it was in."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ...candidate import Candidate
from ...context import StepContext
from ..finetune import Batches, DistillHooks, distill
from .config import PruneConfig
from .graph import PruneGraph, count_macs_params, keep_units, sync_attention
from .planner import Plan
from .planning import unit_importance
from .state import RoundState

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import nn

__all__ = ["run_rounds"]

log = logging.getLogger("slimline.prune")


def _round_targets(cfg: PruneConfig, graph: PruneGraph, plan: Plan, i: int) -> dict[str, int]:
    if i == cfg.rounds:
        return dict(plan.keep)
    frac = i / cfg.rounds
    return {
        n: keep_units(g.size, plan.ratios[n] * frac, g.kind, cfg.round_to, cfg.max_ratio)
        for n, g in graph.groups.items()
    }


def _take_shape(graph: PruneGraph, history: list[list[Any]]) -> None:
    """Replay a saved pruning history on the unpruned model: the layer shapes it had."""
    graph.dg.load_pruning_history([list(h) for h in history])
    sync_attention(graph.model)


def _resume(graph: PruneGraph, state: RoundState) -> None:
    _take_shape(graph, state.data["history"])
    graph.model.load_state_dict(state.load_round())
    log.info("prune: resuming after round %d from %s", state.rounds_done, state.root)


def _one_round(
    cfg: PruneConfig,
    ctx: StepContext,
    graph: PruneGraph,
    teacher: nn.Module,
    data: Batches,
    source: str,
    plan: Plan,
    i: int,
    state: RoundState,
    partial: dict[str, Any] | None = None,
    hooks: DistillHooks | None = None,
) -> dict[str, Any]:
    start = time.perf_counter()
    record: dict[str, Any] = {"round": i}
    if partial is not None:  # pruned before a kill; the model already has this round's shape
        removed, imp_name = partial["removed"], partial["importance"]
    else:
        targets = _round_targets(cfg, graph, plan, i)
        todo = {n: k for n, k in targets.items() if graph.units(n) > k}
        if not todo:
            return {**record, "skipped": "rounding leaves nothing to remove at this round's ratios"}
        importance, imp_name = unit_importance(cfg, ctx, graph.model, teacher, data, source)
        removed = {n: graph.prune_to(n, k, importance) for n, k in todo.items()}
        state.start_round(i, graph.history(), removed, imp_name)
    graph.model.zero_grad(set_to_none=True)
    update: dict[str, Any] = {"progress": cfg.progress and cfg.finetune.progress}
    if i == cfg.rounds and cfg.final_steps is not None:
        update["steps"] = cfg.final_steps
    ft_cfg = cfg.finetune.model_copy(update=update)
    ft = distill(
        graph.model,
        teacher,
        data,
        ft_cfg,
        output_kind=ctx.task.output_kind,
        task=ctx.task,
        desc=f"prune round {i}/{cfg.rounds}",
        checkpoint=state.recovery(i),
        hooks=hooks,
        all_outputs=True,  # a model with several heads recovers on each
    )
    quality = ctx.evaluate(Candidate(f"prune-round-{i}", "prune", None, module=graph.model.eval()))
    macs, params = count_macs_params(graph.model, graph.example)
    return {
        **record,
        "removed_units": removed,
        "importance": imp_name,
        "macs": macs,
        "params": params,
        "metric": quality.metric,
        "cosine_mean": quality.cosine_mean,
        "finetune": {k: v for k, v in ft.to_dict().items() if k != "history"},
        "seconds": round(time.perf_counter() - start, 2),
    }


def run_rounds(
    cfg: PruneConfig,
    ctx: StepContext,
    graph: PruneGraph,
    teacher: nn.Module,
    data: Batches,
    source: str,
    plan: Plan,
    state: RoundState,
    hooks: DistillHooks | None = None,
) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = list(state.data.get("records", []))
    partial = state.partial()
    if partial is not None:  # killed while recovering: take the round's shape, then its weights
        _take_shape(graph, partial["history"])
        log.info("prune: resuming inside round %d from %s", partial["round"], state.root)
    elif state.rounds_done:
        _resume(graph, state)
    first = state.rounds_done + 1
    for i in range(first, cfg.rounds + 1):
        rec = _one_round(
            cfg,
            ctx,
            graph,
            teacher,
            data,
            source,
            plan,
            i,
            state,
            partial if i == first else None,
            hooks,
        )
        records.append(rec)
        state.save_round(i, graph.model, graph.history(), records)
        if "metric" in rec:
            log.info(
                "prune round %d/%d: %s %.4f, cosine %.4f, MACs %d (%.1fs)",
                i,
                cfg.rounds,
                ctx.task.metric_name,
                rec["metric"],
                rec["cosine_mean"],
                rec["macs"],
                rec["seconds"],
            )
    return records
