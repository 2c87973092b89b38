"""Per-group pruning ratios that reach a global MAC or parameter target at the least loss the
sensitivity map predicts.

Each group offers the kept counts its sensitivity row measured (ratios up to the cap, rounded for
alignment). The planner starts from the unpruned model and repeatedly takes the step, over all
groups and all further levels of a group, with the least predicted loss per share removed, until
the target is met; then it walks back any group whose last step is no longer needed. Costs come
from :class:`~slimline.compress.pruning.graph.CostModel` (exact for conv and linear layers),
losses from :func:`~slimline.compress.pruning.sensitivity.table_losses` (summed over groups).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from ...errors import RecipeError
from .graph import CostModel, PrunableGroup, keep_units

__all__ = ["Plan", "check_reachable", "make_plan", "plan_from_ratios"]

Measure = Literal["macs", "params"]


@dataclass
class Plan:
    ratios: dict[str, float]  # group -> requested ratio (0 = untouched)
    keep: dict[str, int]  # group -> units kept after rounding
    removed: float  # predicted share of MACs/params removed
    predicted_loss: float | None
    by: Measure
    target: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Option:
    ratio: float
    keep: int
    loss: float


def _removed(
    cost: CostModel, groups: dict[str, PrunableGroup], keep: dict[str, int], by: Measure
) -> float:
    kept = {n: keep[n] / groups[n].size for n in keep}
    macs, params = cost.cost(kept)
    if by == "macs":
        return 1.0 - macs / cost.total_macs
    return 1.0 - params / cost.total_params


def check_reachable(
    cost: CostModel,
    groups: dict[str, PrunableGroup],
    *,
    target: float,
    by: Measure,
    max_ratio: float,
    round_to: int,
) -> float:
    """The largest share removable under the cap; a :class:`RecipeError` if below ``target``."""
    keep = {
        n: keep_units(g.size, max_ratio, g.kind, round_to, max_ratio) for n, g in groups.items()
    }
    best = _removed(cost, groups, keep, by)
    if best + 1e-9 < target:
        floor = math.floor(best * 100) / 100
        raise RecipeError(
            f"prune target {target:.0%} of {by} is unreachable: with every prunable group at the "
            f"{max_ratio:.0%} cap at most {best:.1%} can be removed ({len(groups)} groups; first/last "
            f"and excluded layers stay); set `target` to {floor:.2f} or less, or raise `max_ratio`"
        )
    return best


def _options(
    groups: dict[str, PrunableGroup],
    table: dict[str, Any],
    losses: dict[str, list[float]],
    max_ratio: float,
) -> dict[str, list[_Option]]:
    opts: dict[str, list[_Option]] = {}
    for name, g in groups.items():
        row = table["groups"][name]
        seen: dict[int, _Option] = {g.size: _Option(0.0, g.size, 0.0)}
        for r, keep, loss in zip(table["ratios"], row["keep"], losses[name], strict=True):
            if r <= max_ratio + 1e-9 and keep not in seen:
                seen[keep] = _Option(float(r), int(keep), float(loss))
        opts[name] = sorted(seen.values(), key=lambda o: -o.keep)
    return opts


def make_plan(
    groups: dict[str, PrunableGroup],
    table: dict[str, Any],
    losses: dict[str, list[float]],
    cost: CostModel,
    *,
    target: float,
    by: Measure,
    max_ratio: float,
) -> Plan:
    """Greedy allocation of per-group ratios reaching ``target`` (a share of ``by``)."""
    opts = _options(groups, table, losses, max_ratio)
    level = dict.fromkeys(groups, 0)

    def keep_of(lv: dict[str, int]) -> dict[str, int]:
        return {n: opts[n][i].keep for n, i in lv.items()}

    removed = 0.0
    while removed + 1e-9 < target:
        best: tuple[float, str, int, float] | None = None
        for name, cur in level.items():
            for j in range(cur + 1, len(opts[name])):
                gain = _removed(cost, groups, keep_of({**level, name: j}), by) - removed
                if gain <= 0:
                    continue
                score = (opts[name][j].loss - opts[name][cur].loss + 1e-9) / gain
                if best is None or score < best[0]:
                    best = (score, name, j, removed + gain)
        if best is None:
            reach = _removed(cost, groups, keep_of({n: len(o) - 1 for n, o in opts.items()}), by)
            raise RecipeError(
                f"prune target {target:.0%} of {by} is unreachable with the measured ratios: at "
                f"most {reach:.1%} can be removed; set `target` to {math.floor(reach * 100) / 100:.2f} "
                "or less, or add larger `ratios` (up to `max_ratio`)"
            )
        _, name, j, removed = best
        level[name] = j
    level, removed = _walk_back(level, opts, groups, cost, target, by)
    keep = keep_of(level)
    return Plan(
        ratios={n: opts[n][i].ratio for n, i in level.items()},
        keep=keep,
        removed=removed,
        predicted_loss=float(sum(opts[n][i].loss for n, i in level.items())),
        by=by,
        target=target,
    )


def _walk_back(
    level: dict[str, int],
    opts: dict[str, list[_Option]],
    groups: dict[str, PrunableGroup],
    cost: CostModel,
    target: float,
    by: Measure,
) -> tuple[dict[str, int], float]:
    """Undo steps the target no longer needs, costliest first."""
    level = dict(level)
    for name in sorted(level, key=lambda n: -opts[n][level[n]].loss):
        while level[name] > 0:
            trial = {**level, name: level[name] - 1}
            if (
                _removed(cost, groups, {n: opts[n][i].keep for n, i in trial.items()}, by) + 1e-9
                < target
            ):
                break
            level = trial
    return level, _removed(cost, groups, {n: opts[n][i].keep for n, i in level.items()}, by)


def plan_from_ratios(
    groups: dict[str, PrunableGroup],
    ratios: dict[str, float],
    cost: CostModel,
    *,
    by: Measure,
    max_ratio: float,
    round_to: int,
) -> Plan:
    """A plan given in the recipe (e.g. an edited plan from an earlier run's manifest)."""
    unknown = sorted(set(ratios) - set(groups))
    if unknown:
        raise RecipeError(
            f"prune plan names unknown groups {unknown}; the prunable groups are "
            f"{sorted(groups)} (copy the plan from a run's manifest and edit its ratios)"
        )
    over = {n: r for n, r in ratios.items() if not 0.0 <= r <= max_ratio}
    if over:
        raise RecipeError(
            f"prune plan ratios {over} are outside [0, {max_ratio}]; lower them or raise `max_ratio`"
        )
    full = {n: float(ratios.get(n, 0.0)) for n in groups}
    keep = {n: keep_units(g.size, full[n], g.kind, round_to, max_ratio) for n, g in groups.items()}
    return Plan(full, keep, _removed(cost, groups, keep, by), None, by, None)
