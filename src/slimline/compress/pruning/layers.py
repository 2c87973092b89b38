"""A prune step's depth stage (``layers:``): the layer sensitivity table, the plan (by MACs, or
priced by measured latency), the layers dropped and the student recovered by distillation, each
kept layer matched to the teacher layer it came from."""

from __future__ import annotations

import logging
import shutil
import time
from typing import TYPE_CHECKING, Any

from ...candidate import Candidate
from ...context import StepContext
from ...export import ExportConfig
from ...module_guard import private_copy
from ..finetune import Batches, FileCheckpoint, distill
from .config import PruneConfig
from .depth import (
    LayerMapHooks,
    StackInfo,
    check_depth_request,
    check_target,
    drop_entry,
    drop_layers,
    droppable,
    find_stack,
    layer_macs,
    layer_sensitivity,
    make_depth_plan,
    plan_of,
)
from .pricing import Option, ShapeSpec, choose, price_options
from .sensitivity import Evaluator
from .state import RoundState, save_torch

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import Tensor, nn

__all__ = ["DepthRequest", "DepthStage", "check_depth", "run_depth"]

log = logging.getLogger("slimline.prune")
DEPTH_SWEEP_KIND = "prune-depth-sweep"  # the layer sensitivity tables' entries
DEPTH_WEIGHTS = "depth.pt"  # the depth-pruned, recovered model in a step's work directory
DEPTH_PARTIAL = "partial-depth.pt"  # its recovery's training state, while it runs

DepthRequest = tuple[StackInfo, list[float], int]  # the stack, MACs per layer, the model's MACs


class DepthStage:
    def __init__(
        self,
        model: nn.Module,
        entry: dict[str, Any],
        hooks: LayerMapHooks,
        meta: dict[str, Any],
        width: float = 0.0,
    ) -> None:
        self.model, self.entry, self.hooks, self.meta = model, entry, hooks, meta
        self.width = width  # share to thin every width group by next (a latency-priced plan)


def check_depth(
    cfg: PruneConfig, module: nn.Module, example: dict[str, Tensor]
) -> DepthRequest | None:
    """The stack and its per-layer MACs, after checking the request against them."""
    if cfg.layers is None:
        return None
    stack = find_stack(module, cfg.layers.path)
    check_depth_request(cfg.layers, stack)
    per, total = layer_macs(module, example, stack)
    check_target(cfg.layers, stack, per, total)
    return stack, per, total


def _depth_table(
    cfg: PruneConfig,
    ctx: StepContext,
    cand: Candidate,
    teacher: nn.Module,
    stack: StackInfo,
    example: dict[str, Tensor],
    state: RoundState,
) -> dict[str, Any] | None:
    """Each droppable layer dropped alone (cached in the step cache, kept in the checkpoint)."""
    layers = cfg.layers
    assert layers is not None
    if layers.keep is not None:
        return None
    candidates = droppable(stack.size, layers.keep_first_last)
    conf = {"path": stack.path, "layers": candidates, "samples": layers.sensitivity_samples,
            "fidelity_weight": layers.fidelity_weight}  # fmt: skip
    key = ctx.cache_key(cfg, cand, depth_sweep=conf)
    cache = ctx.step_cache()
    table: dict[str, Any] | None = state.data.get("depth_sensitivity") or cache.get_json(
        DEPTH_SWEEP_KIND, key
    )
    if table is None:
        evaluator = Evaluator(teacher, ctx.task, layers.sensitivity_samples, example)
        table = layer_sensitivity(evaluator, stack, candidates, layers.fidelity_weight)
        cache.put_json(DEPTH_SWEEP_KIND, key, table)
        log.info("layer sensitivity: %d layers in %.1fs", len(candidates), table["seconds"])
    state.save(depth_sensitivity=table)
    return table


def run_depth(
    cfg: PruneConfig,
    ctx: StepContext,
    cand: Candidate,
    module: nn.Module,
    teacher: nn.Module,
    data: Batches,
    state: RoundState,
    example: dict[str, Tensor],
    request: DepthRequest,
) -> DepthStage:
    """Drop the planned layers from a copy of ``module`` and recover it by distillation, each
    kept layer matched to the teacher layer it came from; resumable inside the recovery."""
    import torch

    assert cfg.layers is not None
    stack, per, total = request
    table = _depth_table(cfg, ctx, cand, teacher, stack, example, state)
    options, chosen = None, None
    if cfg.layers.latency is not None:
        assert table is not None
        options, chosen = _priced(cfg, ctx, teacher, stack, table, example, state)
        plan = plan_of(stack, chosen.dropped, per, total, chosen.loss, _why(chosen, cfg))
    else:
        plan = make_depth_plan(cfg.layers, stack, per, total, table)
    state.save(depth_plan=plan.to_dict())
    student = drop_layers(private_copy(module).eval(), stack.path, plan.keep)
    hooks = LayerMapHooks(stack.path, stack.path, plan.keep)
    record: dict[str, Any] | None = state.data.get("depth_record")
    if record is not None and (state.root / DEPTH_WEIGHTS).is_file():
        student.load_state_dict(torch.load(state.root / DEPTH_WEIGHTS, weights_only=True))
        log.info("prune layers: reusing the recovered depth-pruned model in %s", state.root)
    else:
        last = not cfg.thins and (chosen is None or chosen.width == 0)
        record = _recover_depth(cfg, ctx, student, teacher, data, state, hooks, last)
    meta = {"stack": stack.path, "block": stack.block, "plan": plan.to_dict(),
            "sensitivity": table, "recovery": record,
            "options": None if options is None else [o.to_dict() for o in options],
            "width": None if chosen is None else chosen.width}  # fmt: skip
    width = chosen.width if chosen is not None else 0.0
    return DepthStage(student.eval(), drop_entry(stack.path, plan.keep), hooks, meta, width)


def _why(chosen: Option, cfg: PruneConfig) -> str:
    assert cfg.layers is not None and chosen.ratio is not None
    return (
        f"least loss before recovery ({chosen.loss:.4f}) among the options timed at or below "
        f"{cfg.layers.latency:.2f}x of the unpruned latency: {chosen.name} at {chosen.ratio:.3f}x"
    )


def _priced(
    cfg: PruneConfig,
    ctx: StepContext,
    teacher: nn.Module,
    stack: StackInfo,
    table: dict[str, Any],
    example: dict[str, Tensor],
    state: RoundState,
) -> tuple[list[Option], Option]:
    """The options priced by timing (once: a resumed run keeps the first run's choice)."""
    layers = cfg.layers
    assert layers is not None and layers.latency is not None
    saved = state.data.get("depth_options")
    if saved is not None:
        options = [Option(**o) for o in saved]
        return options, choose(options, layers.latency)
    spec = ShapeSpec(tuple(cfg.exclude), cfg.keep_first_last, cfg.round_to, cfg.max_ratio, cfg.by)
    options = price_options(
        teacher=teacher,
        stack=stack,
        table=table,
        widths=layers.widths,
        keep_first_last=layers.keep_first_last,
        spec=spec,
        evaluator=Evaluator(teacher, ctx.task, layers.sensitivity_samples, example),
        fidelity_weight=layers.fidelity_weight,
        example=example,
        sample=ctx.task.sample_inputs(1),
        workdir=state.root / "options",
        opset=ctx.recipe.step_config(ExportConfig).opset,
        int8=layers.price_int8,
        threads=ctx.threads,
        rounds=layers.price_rounds,
    )
    shutil.rmtree(state.root / "options", ignore_errors=True)
    state.save(depth_options=[o.to_dict() for o in options])
    return options, choose(options, layers.latency)


def _recover_depth(
    cfg: PruneConfig,
    ctx: StepContext,
    student: nn.Module,
    teacher: nn.Module,
    data: Batches,
    state: RoundState,
    hooks: LayerMapHooks,
    last: bool,
) -> dict[str, Any]:
    start = time.perf_counter()
    update: dict[str, Any] = {"progress": cfg.progress and cfg.finetune.progress}
    if last and cfg.final_steps is not None:  # the depth recovery is what ships
        update["steps"] = cfg.final_steps
    ft = distill(
        student,
        teacher,
        data,
        cfg.finetune.model_copy(update=update),
        output_kind=ctx.task.output_kind,
        task=ctx.task,
        desc="prune layers",
        checkpoint=FileCheckpoint(state.root / DEPTH_PARTIAL, "prune: recovery"),
        hooks=hooks,
        all_outputs=True,  # a model with several heads recovers on each
    )
    quality = ctx.evaluate(Candidate("prune-layers", "prune", None, module=student.eval()))
    record = {
        "metric": quality.metric,
        "cosine_mean": quality.cosine_mean,
        "finetune": {k: v for k, v in ft.to_dict().items() if k != "history"},
        "layer_map": hooks.pairs(),
        "seconds": round(time.perf_counter() - start, 2),
    }
    save_torch(state.root / DEPTH_WEIGHTS, student.state_dict())
    state.save(depth_record=record)
    (state.root / DEPTH_PARTIAL).unlink(missing_ok=True)
    return record
