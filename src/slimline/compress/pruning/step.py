"""The ``prune`` step: sensitivity map -> plan -> rounds of pruning, each recovered by distillation.

The step returns the pruned dense model and its verified ONNX export; the pipeline accepts it only
if it is within budget and measurably faster. Progress is checkpointed after every round in a work
directory of the step cache (:meth:`StepCache.work_dir`, keyed like the step's own entry: input
model, config, data, step version, package versions; atomic writes), and inside a round at every
held-out evaluation of its recovery, so a killed run resumes where it was: inside the round being
recovered, or after the last finished round; the plan is kept there too, and the sensitivity
table is a JSON entry of the step cache that a run with another target or fine-tuning reuses.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ...candidate import Candidate
from ...context import StepContext
from ...errors import RecipeError, StepError
from ...module_guard import private_copy, torch_threads
from ...recipe import StepConfig
from ...record import atomic_write_bytes, atomic_write_json
from ...records import PruneRecord
from ...steps import Contract, step
from ...task import Task
from ..finetune import (
    DistillHooks,
    FileCheckpoint,
    FinetuneConfig,
    accumulate_gradients,
    distill,
    resolve_data,
    to_tensors,
)
from .depth import (
    LayerMapHooks,
    LayersConfig,
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
    replay_history,
)
from .graph import (
    CostModel,
    PruneGraph,
    count_macs_params,
    keep_units,
    sync_attention,
)
from .planner import Plan, check_reachable, make_plan, plan_from_ratios
from .pricing import Option, ShapeSpec, choose, price_options
from .sensitivity import Evaluator, SweepSpec, run_sweep, table_losses

__all__ = ["PruneConfig", "prune_step", "restore_pruned"]

log = logging.getLogger("slimline.prune")
HISTORY_ATTR = "_slimline_prune_history"  # pruning history carried by a pruned module
WEIGHTS_FILE = "pruned.pt"
HISTORY_FILE = "prune_history.json"
SWEEP_KIND = "prune-sweep"  # the sensitivity tables' entries in the step cache
DEPTH_SWEEP_KIND = "prune-depth-sweep"  # the layer sensitivity tables' entries
DEPTH_WEIGHTS = "depth.pt"  # the depth-pruned, recovered model in a step's work directory
DEPTH_PARTIAL = "partial-depth.pt"  # its recovery's training state, while it runs


class PruneConfig(StepConfig):
    kind: ClassVar[str] = "prune"
    not_in_key: ClassVar[frozenset[str]] = frozenset({"progress", "workers", "ray_address"})
    target: float = Field(0.3, gt=0.0, lt=1.0, description="share of MACs (or params) to remove")
    by: Literal["macs", "params"] = "macs"
    max_ratio: float = Field(0.8, gt=0.0, lt=1.0, description="no group pruned beyond this")
    ratios: list[float] = Field(
        default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
        description="ratios of the sensitivity sweep",
    )
    round_to: int = Field(8, ge=1, le=256, description="kept channels: a multiple of this")
    keep_first_last: bool = Field(
        True, description="keep the first layer whole (output layers always are)"
    )
    exclude: list[str] = Field(default_factory=list, description="module-name patterns kept whole")
    importance: Literal["auto", "magnitude", "taylor"] = Field(
        "auto", description="auto: Taylor with training data, L2 magnitude otherwise"
    )
    taylor_batches: int = Field(8, ge=1, le=1000)
    plan: dict[str, float] | None = Field(
        None, description="per-group ratios (from a run's manifest); skips sweep and planner"
    )
    rounds: int = Field(
        10, ge=1, le=100, description="pruning rounds, each followed by fine-tuning"
    )
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    final_steps: int | None = Field(
        None,
        ge=0,
        description="fine-tuning steps after the last round (default: finetune.steps); the "
        "final model is what ships, so its recovery is usually the one worth paying for",
    )
    sensitivity_samples: int = Field(1000, ge=1, description="evaluation rows for the sweep")
    fidelity_weight: float = Field(1.0, ge=0.0, description="weight of (1 - cosine) in the loss")
    workers: int = Field(
        0, ge=0, le=256, description="sweep processes: 0 = target threads, 1 = none"
    )
    ray_address: str | None = Field(None, description="run the sweep on this Ray cluster")
    example_batch: int = Field(2, ge=1, le=64)
    layers: LayersConfig | None = Field(
        None, description="drop whole layers of the encoder stack first (depth pruning)"
    )
    width: bool | None = Field(
        None,
        description="thin the layers (heads, FFN neurons, channels) to `target`; default: "
        "yes without `layers`, no with it",
    )
    progress: bool = True

    @model_validator(mode="after")
    def _prunes_something(self) -> PruneConfig:
        if self.width is False and self.layers is None:
            raise ValueError("width: false without layers prunes nothing; add layers: {drop: N}")
        return self

    def key_dict(self) -> dict[str, Any]:
        """Without ``layers`` and ``width`` while unset: a width-only step keeps the cache key
        it had before depth pruning existed (its result did not change)."""
        data = super().key_dict()
        for name in ("layers", "width"):
            if data.get(name) is None:
                data.pop(name, None)
        return data

    @property
    def thins(self) -> bool:
        """Whether the step prunes width (heads, neurons, channels) to ``target``."""
        return self.width if self.width is not None else self.layers is None

    @field_validator("ratios")
    @classmethod
    def _valid_ratios(cls, v: list[float]) -> list[float]:
        if not v or any(not 0.0 < r < 1.0 for r in v):
            raise ValueError(
                "ratios must be a non-empty list of values in (0, 1), e.g. [0.1, 0.2, 0.4]"
            )
        return sorted(set(v))


# -- restoring a pruned module (pipeline cache) ------------------------------------------------
def _save_module(workdir: Path, module: Any, history: list[Any]) -> dict[str, str]:
    import torch

    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    atomic_write_bytes(workdir / WEIGHTS_FILE, buf.getvalue())
    atomic_write_json(workdir / HISTORY_FILE, history)
    return {"weights": WEIGHTS_FILE, "history_file": HISTORY_FILE}


def restore_pruned(entry: Path, meta: dict[str, Any], task: Task) -> Any:
    """Rebuild the pruned module of a cached prune step: a copy of the task's model, the
    recorded channel removals re-applied, then the saved weights
    (``torch.load(weights_only=True)``). The task's own module is left as it was: ``model()``
    may return the same object every call, and it is the FP32 baseline."""
    import torch

    if task.model is None:
        raise StepError(f"task {task.name} has no model(); a cached prune step cannot be restored")
    history = json.loads((Path(entry) / meta["history_file"]).read_text())
    model = private_copy(task.model()).eval()
    replay_history(model, to_tensors(task.sample_inputs(2)), history)
    model.load_state_dict(torch.load(Path(entry) / meta["weights"], weights_only=True))
    setattr(model, HISTORY_ATTR, history)
    return model.eval()


# -- round checkpoints -------------------------------------------------------------------------
class RoundState:
    """Checkpoint of a prune step in progress: sweep table, plan, finished rounds."""

    def __init__(self, root: Path) -> None:
        self.root = root
        path = root / "state.json"
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    @property
    def rounds_done(self) -> int:
        return int(self.data.get("rounds_done", 0))

    def save(self, **items: Any) -> None:
        self.data.update(items)
        atomic_write_json(self.root / "state.json", self.data)

    def save_round(
        self, i: int, model: Any, history: list[list[Any]], records: list[dict[str, Any]]
    ) -> None:
        _save_torch(self.root / f"round-{i}.pt", model.state_dict())
        self.save(rounds_done=i, history=history, records=records, partial=None)
        for old in [*self.root.glob("round-*.pt"), *self.root.glob("partial-*.pt")]:
            if old.name != f"round-{i}.pt":
                old.unlink(missing_ok=True)

    def start_round(
        self, i: int, history: list[list[Any]], removed: dict[str, int], imp: str
    ) -> None:
        """Round ``i`` has pruned and starts recovering: what it removed, for a resume mid-way."""
        (self.root / f"partial-{i}.pt").unlink(missing_ok=True)
        self.save(partial={"round": i, "history": history, "removed": removed, "importance": imp})

    def partial(self) -> dict[str, Any] | None:
        """The unfinished round after the last finished one, if its recovery saved a checkpoint."""
        part = self.data.get("partial")
        if not part or part["round"] != self.rounds_done + 1:
            return None
        return part if (self.root / f"partial-{part['round']}.pt").is_file() else None

    def recovery(self, i: int) -> FileCheckpoint:
        return FileCheckpoint(self.root / f"partial-{i}.pt", "prune: recovery")

    def load_round(self) -> Any:
        import torch

        return torch.load(self.root / f"round-{self.rounds_done}.pt", weights_only=True)

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _save_torch(path: Path, obj: Any) -> None:
    """``torch.save`` of tensors and plain data, atomically (read back with weights_only)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def _state_dir(cfg: PruneConfig, cand: Candidate, ctx: StepContext) -> Path:
    return ctx.step_cache().work_dir(ctx.cache_key(cfg, cand, config=cfg.key_dict()))


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


def _sweep_key(
    cfg: PruneConfig, cand: Candidate, ctx: StepContext, depth: dict[str, Any] | None = None
) -> str:
    """Key of the sensitivity table of this model and sweep setting in the step cache, so that
    a run with another target, plan or fine-tuning setting reuses it."""
    conf = {k: getattr(cfg, k) for k in _SWEEP_KEYS}
    conf["data"] = cfg.finetune.data  # decides Taylor vs magnitude ranking
    if depth is not None:  # the layers dropped first (and their recovery) shape the table
        conf["depth"] = {"entry": depth, "finetune": cfg.finetune.key_dict()}
    return ctx.cache_key(cfg, cand, sweep=conf)


# -- importance --------------------------------------------------------------------------------
def _importance(
    cfg: PruneConfig, ctx: StepContext, model: Any, teacher: Any, data: Any, source: str
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


# -- planning ----------------------------------------------------------------------------------
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


def _plan(
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


# -- rounds ------------------------------------------------------------------------------------
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
    teacher: Any,
    data: Any,
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
        importance, imp_name = _importance(cfg, ctx, graph.model, teacher, data, source)
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


def _run_rounds(
    cfg: PruneConfig,
    ctx: StepContext,
    graph: PruneGraph,
    teacher: Any,
    data: Any,
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


# -- the step ----------------------------------------------------------------------------------
def _export(ctx: StepContext, module: Any) -> tuple[Path, dict[str, Any]]:
    from ...export import ExportConfig, export_module, verify_export

    cfg = ctx.recipe.step_config(ExportConfig)
    sample = ctx.task.sample_inputs(cfg.check_samples)
    path = export_module(module, sample, ctx.workdir / "model.onnx", cfg.opset)
    return path, verify_export(module, path, sample, cfg, ctx.threads)


def _torch_view(ctx: StepContext, teacher: Any, pruned: Any) -> dict[str, Any] | None:
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


def _input_module(cand: Candidate) -> Any:
    if cand.module is None:
        raise StepError(
            f"prune needs a torch model, but candidate {cand.name} is an ONNX file only; give a "
            "task .py whose model() returns the torch.nn.Module"
        )
    return cand.module


def _graph(cfg: PruneConfig, module: Any, example: dict[str, Any]) -> PruneGraph:
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


def _frozen(module: Any) -> Any:
    teacher = private_copy(module).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def _share(before: int, after: int) -> dict[str, Any]:
    return {"before": before, "after": after, "removed": 1 - after / before}


@step(
    PruneConfig,
    contract=Contract(consumes=("torch",), produces=("torch", "onnx")),
    version=1,
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
    request = _check_depth(cfg, module, example)  # a plan that cannot work fails before any work
    base_history = list(getattr(module, HISTORY_ATTR, []))
    teacher = _frozen(module)
    data, source, note = resolve_data(ctx.task, cfg.finetune)
    if note:
        ctx.warn(note)
    state = RoundState(_state_dir(cfg, cand, ctx))
    depth = None
    if request is not None:
        depth = _run_depth(cfg, ctx, cand, module, teacher, data, state, example, request)
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
    start: Any,
    teacher: Any,
    data_source: tuple[Any, str],
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
        plan, table = _plan(
            cfg,
            ctx,
            graph,
            cost,
            lambda: _importance(cfg, ctx, graph.model, teacher, data, source)[0],
            state,
            _sweep_key(cfg, cand, ctx, depth),
            base_history,
        )
    state.save(plan=plan.to_dict())
    resumed = state.rounds_done
    records = _run_rounds(cfg, ctx, graph, teacher, data, source, plan, state, hooks)
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


# -- depth -------------------------------------------------------------------------------------
DepthRequest = tuple[StackInfo, list[float], int]  # the stack, MACs per layer, the model's MACs


class _Depth:
    def __init__(
        self,
        model: Any,
        entry: dict[str, Any],
        hooks: LayerMapHooks,
        meta: dict[str, Any],
        width: float = 0.0,
    ) -> None:
        self.model, self.entry, self.hooks, self.meta = model, entry, hooks, meta
        self.width = width  # share to thin every width group by next (a latency-priced plan)


def _check_depth(cfg: PruneConfig, module: Any, example: dict[str, Any]) -> DepthRequest | None:
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
    teacher: Any,
    stack: StackInfo,
    example: dict[str, Any],
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


def _run_depth(
    cfg: PruneConfig,
    ctx: StepContext,
    cand: Candidate,
    module: Any,
    teacher: Any,
    data: Any,
    state: RoundState,
    example: dict[str, Any],
    request: DepthRequest,
) -> _Depth:
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
    return _Depth(student.eval(), drop_entry(stack.path, plan.keep), hooks, meta, width)


def _why(chosen: Option, cfg: PruneConfig) -> str:
    assert cfg.layers is not None and chosen.ratio is not None
    return (
        f"least loss before recovery ({chosen.loss:.4f}) among the options timed at or below "
        f"{cfg.layers.latency:.2f}x of the unpruned latency: {chosen.name} at {chosen.ratio:.3f}x"
    )


def _priced(
    cfg: PruneConfig,
    ctx: StepContext,
    teacher: Any,
    stack: StackInfo,
    table: dict[str, Any],
    example: dict[str, Any],
    state: RoundState,
) -> tuple[list[Option], Option]:
    """The options priced by timing (once: a resumed run keeps the first run's choice)."""
    from ...export import ExportConfig

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
    student: Any,
    teacher: Any,
    data: Any,
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
    )
    quality = ctx.evaluate(Candidate("prune-layers", "prune", None, module=student.eval()))
    record = {
        "metric": quality.metric,
        "cosine_mean": quality.cosine_mean,
        "finetune": {k: v for k, v in ft.to_dict().items() if k != "history"},
        "layer_map": hooks.pairs(),
        "seconds": round(time.perf_counter() - start, 2),
    }
    _save_torch(state.root / DEPTH_WEIGHTS, student.state_dict())
    state.save(depth_record=record)
    (state.root / DEPTH_PARTIAL).unlink(missing_ok=True)
    return record
