"""Depth pruning: whole blocks of an encoder stack removed by their measured sensitivity.

The stack is a ``torch.nn.ModuleList`` of blocks of one type (a BERT-family encoder's
``encoder.layer`` from ``transformers``, or any model's own list of blocks), found by its shape
or named by ``layers: {path: ...}``. Each droppable layer is dropped alone and the task metric and
the cosine to the unpruned outputs are measured on an evaluation subset (the sensitivity
table); the plan drops the least sensitive layers until a layer count or a share of the MACs is
reached, the first and last kept unless allowed. Removal is real: the list is rebuilt from the
kept blocks (a smaller export), a ``transformers`` config's ``num_hidden_layers`` follows, and
the removal is one entry of the pruned module's history, so a cached result reloads from its
state dict (:func:`replay_history`). Recovery distils with each kept student layer's output
matched to the output of the teacher layer it came from (:class:`LayerMapHooks`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import Field, field_validator, model_validator

from ...config import Config
from ...errors import RecipeError
from ..finetune import DistillHooks, FeatureTap, FinetuneConfig
from .graph import _count_layers, apply_history

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import Tensor, nn

__all__ = [
    "DepthPlan",
    "LayerMapHooks",
    "LayersConfig",
    "StackInfo",
    "check_depth_request",
    "drop_layers",
    "find_stack",
    "layer_sensitivity",
    "make_depth_plan",
    "plan_of",
    "replay_history",
]

DROP_OP = "drop_layers"  # the history entry of a depth removal
COMMON_NAMES = ("encoder.layer", "layers", "layer", "blocks", "h")  # how stacks are usually named


class LayersConfig(Config):
    """``prune: {layers: ...}``: which layers of the encoder stack to drop."""

    path: str | None = Field(
        None, description="dotted name of the nn.ModuleList of blocks (default: found)"
    )
    drop: int | None = Field(None, ge=1, description="drop this many layers")
    target: float | None = Field(
        None, gt=0.0, lt=1.0, description="drop layers until this share of the MACs is removed"
    )
    keep: list[int] | None = Field(
        None, description="the layers to keep, by index (skips the sensitivity table)"
    )
    latency: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="drop layers and thin the rest until the shape times at this share of the "
        "unpruned model's latency on the target (options priced by timing, before recovery)",
    )
    widths: list[float] = Field(
        default_factory=lambda: [0.0],
        description="with latency: the shares of every width group (heads, FFN neurons) to "
        "try removing from the kept layers",
    )
    price_rounds: int = Field(5, ge=1, le=50, description="interleaved rounds timing options")
    price_int8: bool = Field(
        True, description="time options quantized (dynamic S8 per-channel), as INT8 will run"
    )
    keep_first_last: bool = Field(True, description="never drop the first or the last layer")
    sensitivity_samples: int = Field(200, ge=1, description="evaluation rows per layer dropped")
    fidelity_weight: float = Field(1.0, ge=0.0, description="weight of (1 - cosine) in the loss")

    @field_validator("keep")
    @classmethod
    def _valid_keep(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or len(set(v)) != len(v) or min(v) < 0):
            raise ValueError("keep must list distinct layer indices >= 0, e.g. [0, 2, 3, 5]")
        return None if v is None else sorted(v)

    @field_validator("widths")
    @classmethod
    def _valid_widths(cls, v: list[float]) -> list[float]:
        if any(not 0.0 <= w < 1.0 for w in v):
            raise ValueError("widths are shares in [0, 1), e.g. [0, 0.25]")
        return sorted({0.0, *v})

    @model_validator(mode="after")
    def _one_request(self) -> LayersConfig:
        given = [k for k in ("drop", "target", "keep", "latency") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"layers needs exactly one of drop, target, keep or latency (got {given or 'none'})"
            )
        if self.widths != [0.0] and self.latency is None:
            raise ValueError("layers.widths needs layers.latency (options priced by timing)")
        return self


# -- the stack ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StackInfo:
    path: str
    size: int
    block: str  # the blocks' class name


def _module_lists(model: nn.Module) -> list[tuple[str, Any]]:
    import torch.nn as nn

    found = []
    for name, mod in model.named_modules():
        one_type = isinstance(mod, nn.ModuleList) and len({type(b) for b in mod}) == 1
        if name and one_type and len(mod) >= 2:
            found.append((name, mod))
    return found


def find_stack(model: nn.Module, path: str | None = None) -> StackInfo:
    """The encoder stack of ``model``: the list named ``path``, else the module list of two or
    more blocks of one type holding the most parameters. A :class:`RecipeError` names what was
    looked for when there is none."""
    import torch.nn as nn

    if path is not None:
        mods = dict(model.named_modules())
        mod = mods.get(path)
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            found = [n for n, _ in _module_lists(model)]
            what = "no module" if mod is None else f"a {type(mod).__name__}"
            raise RecipeError(
                f"prune layers.path {path!r} is {what} in {type(model).__name__}, not an "
                f"nn.ModuleList of 2 or more blocks; module lists found: {found or 'none'}"
            )
        return StackInfo(path, len(mod), type(mod[0]).__name__)
    lists = _module_lists(model)
    if not lists:
        raise RecipeError(
            f"prune layers: found no layer stack in {type(model).__name__}: looked for an "
            f"nn.ModuleList of 2 or more blocks of one type (e.g. {', '.join(COMMON_NAMES)}); "
            "name the model's list of blocks with `layers: {path: ...}`"
        )
    name, mod = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return StackInfo(name, len(mod), type(mod[0]).__name__)


def drop_layers(model: nn.Module, path: str, keep: list[int]) -> nn.Module:
    """Rebuild the stack at ``path`` from the blocks ``keep`` (in place), so the removed blocks
    are gone from the module, its state dict and its export. A ``transformers`` config's
    ``num_hidden_layers`` and the blocks' ``layer_idx`` follow the new numbering."""
    import torch.nn as nn

    parent_name, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList([old[i] for i in keep]))
    for j, block in enumerate(getattr(parent, attr)):
        for sub in block.modules():
            if isinstance(getattr(sub, "layer_idx", None), int):
                sub.layer_idx = j
    seen: set[int] = set()
    for mod in model.modules():
        config: Any = getattr(mod, "config", None)
        if id(config) not in seen and isinstance(getattr(config, "num_hidden_layers", None), int):
            seen.add(id(config))
            config.num_hidden_layers = len(keep)
    return model


def drop_entry(path: str, keep: list[int]) -> dict[str, Any]:
    return {"op": DROP_OP, "path": path, "keep": list(keep)}


def replay_history(model: nn.Module, example: dict[str, Tensor], history: list[Any]) -> nn.Module:
    """Re-apply a pruned module's history to a fresh copy of the unpruned model (in place):
    layer drops and, between them, Torch-Pruning's channel removals, in the order they were
    made."""
    pending: list[list[Any]] = []
    for entry in history:
        if isinstance(entry, dict) and entry.get("op") == DROP_OP:
            apply_history(model, example, pending)
            pending = []
            drop_layers(model, entry["path"], entry["keep"])
        else:
            pending.append(entry)
    return apply_history(model, example, pending)


# -- the request, checked before any work ----------------------------------------------------------
def droppable(n: int, keep_first_last: bool) -> list[int]:
    return list(range(1, n - 1)) if keep_first_last else list(range(n))


def check_depth_request(cfg: LayersConfig, stack: StackInfo) -> None:
    """A :class:`RecipeError` for a request that drops every layer, or the first or the last
    when that is not allowed, or names layers the stack does not have."""
    n, first_last = stack.size, cfg.keep_first_last
    allowed = droppable(n, first_last)
    why = "the first and last are kept (`keep_first_last: true`)" if first_last else ""
    if cfg.keep is not None:
        bad = [i for i in cfg.keep if i >= n]
        if bad:
            raise RecipeError(
                f"prune layers.keep names layers {bad}, but {stack.path} has {n} (0..{n - 1})"
            )
        lost = [i for i in (0, n - 1) if first_last and i not in cfg.keep]
        if lost:
            raise RecipeError(
                f"prune layers.keep drops layer(s) {lost} of {stack.path}, but {why}; add them "
                "to `keep` or set `keep_first_last: false`"
            )
        if len(cfg.keep) == n:
            raise RecipeError(
                f"prune layers.keep keeps all {n} layers of {stack.path}; drop at least one"
            )
    if cfg.drop is not None and cfg.drop >= n:
        raise RecipeError(
            f"prune layers.drop {cfg.drop} drops every layer of {stack.path} ({n} layers); "
            f"drop at most {len(allowed)}"
        )
    if cfg.drop is not None and cfg.drop > len(allowed):
        raise RecipeError(
            f"prune layers.drop {cfg.drop}: {stack.path} has {n} layers and {why}, so at most "
            f"{len(allowed)} can go; lower `drop` or set `keep_first_last: false`"
        )


def layer_macs(
    model: nn.Module, example: dict[str, Tensor], stack: StackInfo
) -> tuple[list[float], int]:
    """MACs at batch 1 of each block of the stack, and of the whole model."""
    total, _, leaf = _count_layers(model, example)
    per = [0.0] * stack.size
    for name, macs in leaf.items():
        head, _, rest = name.partition(stack.path + ".")
        if not head and rest:
            per[int(rest.split(".")[0])] += macs
    return per, total


def check_target(cfg: LayersConfig, stack: StackInfo, per: list[float], total: int) -> None:
    if cfg.target is None:
        return
    best = sum(per[i] for i in droppable(stack.size, cfg.keep_first_last)) / total
    if best + 1e-9 < cfg.target:
        raise RecipeError(
            f"prune layers.target {cfg.target:.0%} of MACs is unreachable: dropping every "
            f"droppable layer of {stack.path} removes {best:.1%}; lower `target`"
            + (" or set `keep_first_last: false`" if cfg.keep_first_last else "")
        )


# -- sensitivity -------------------------------------------------------------------------------
class Scorer(Protocol):
    """What :func:`layer_sensitivity` reads of a :class:`.sensitivity.Evaluator` (which imports
    this module, so it is not imported here)."""

    model: nn.Module
    base_metric: float

    @property
    def samples(self) -> int: ...

    def score(self, model: nn.Module) -> dict[str, float]: ...


def layer_sensitivity(
    evaluator: Scorer, stack: StackInfo, layers: list[int], fidelity_weight: float
) -> dict[str, Any]:
    """Each of ``layers`` dropped alone from a copy of ``evaluator.model``: metric, cosine to
    the unpruned outputs, and the predicted loss (metric drop + ``fidelity_weight`` x
    (1 - cosine)) on the evaluator's subset."""
    start = time.perf_counter()
    rows = []
    for i in layers:
        model = copy.deepcopy(evaluator.model)
        drop_layers(model, stack.path, [j for j in range(stack.size) if j != i])
        score = evaluator.score(model.eval())
        loss = max(0.0, evaluator.base_metric - score["metric"])
        loss += fidelity_weight * max(0.0, 1.0 - score["cosine"])
        rows.append({"layer": i, **score, "loss": round(loss, 6)})
    return {
        "path": stack.path,
        "layers": stack.size,
        "base_metric": evaluator.base_metric,
        "samples": evaluator.samples,
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 2),
    }


# -- plan --------------------------------------------------------------------------------------
@dataclass
class DepthPlan:
    path: str
    layers: int
    keep: list[int]
    dropped: list[int]
    macs_removed: float  # share of the whole model's MACs at batch 1
    predicted_loss: float | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_depth_plan(
    cfg: LayersConfig,
    stack: StackInfo,
    per: list[float],
    total: int,
    table: dict[str, Any] | None,
) -> DepthPlan:
    """The layers to drop: ``keep`` as given, else the least sensitive droppable layers (by
    the table's loss) until ``drop`` layers or ``target`` of the MACs are gone."""
    if cfg.keep is not None:
        given = [i for i in range(stack.size) if i not in cfg.keep]
        return plan_of(stack, given, per, total, None, "layers.keep given in the recipe")
    assert table is not None and cfg.latency is None, "drop or target, with the table"
    loss = {r["layer"]: float(r["loss"]) for r in table["rows"]}
    order = sorted(droppable(stack.size, cfg.keep_first_last), key=lambda i: (loss[i], i))
    dropped: list[int] = []
    for i in order:
        if cfg.drop is not None and len(dropped) >= cfg.drop:
            break
        if cfg.target is not None and sum(per[j] for j in dropped) / total + 1e-9 >= cfg.target:
            break
        dropped.append(i)
    ranked = ", ".join(f"{i}: {loss[i]:.4f}" for i in order)
    reason = f"least sensitive first (loss when dropped alone: {ranked})"
    return plan_of(stack, dropped, per, total, sum(loss[i] for i in dropped), reason)


def plan_of(
    stack: StackInfo,
    dropped: list[int],
    per: list[float],
    total: int,
    loss: float | None,
    reason: str,
) -> DepthPlan:
    dropped = sorted(dropped)
    keep = [i for i in range(stack.size) if i not in dropped]
    removed = sum(per[i] for i in dropped) / total if total else 0.0
    return DepthPlan(stack.path, stack.size, keep, dropped, removed, loss, reason)


# -- recovery ----------------------------------------------------------------------------------
class LayerMapHooks(DistillHooks):
    """Distillation hooks of a depth-pruned student: student layer ``j`` of the stack learns the
    output of teacher layer ``keep[j]``, the layer it came from (relative squared error, over
    unpadded positions, weighted by ``finetune.feature_weight``); the output loss is the run's."""

    def __init__(self, student_path: str, teacher_path: str, keep: list[int]) -> None:
        self.student_path, self.teacher_path, self.keep = student_path, teacher_path, list(keep)

    def pairs(self) -> list[tuple[str, str]]:
        return [
            (f"{self.student_path}.{j}", f"{self.teacher_path}.{i}")
            for j, i in enumerate(self.keep)
        ]

    def feature_taps(
        self, student: nn.Module, teacher: nn.Module, cfg: FinetuneConfig
    ) -> tuple[FeatureTap, FeatureTap] | None:
        if cfg.feature_weight <= 0:
            return None
        pairs = self.pairs()
        return (
            FeatureTap.of_names(student, [s for s, _ in pairs]),
            FeatureTap.of_names(teacher, [t for _, t in pairs]),
        )
