"""Structured pruning: dependency-aware channel and head removal, guided by a sensitivity map,
recovered by distillation. The ``prune`` step lives in :mod:`slimline.compress.pruning.step`, its
configuration in :mod:`.config`."""

from __future__ import annotations

from .graph import (
    CostModel,
    PrunableGroup,
    PruneGraph,
    apply_history,
    count_macs_params,
    keep_units,
)
from .planner import Plan, check_reachable, make_plan, plan_from_ratios
from .sensitivity import Evaluator, run_sweep, table_losses

__all__ = [
    "CostModel",
    "Evaluator",
    "Plan",
    "PrunableGroup",
    "PruneGraph",
    "apply_history",
    "check_reachable",
    "count_macs_params",
    "keep_units",
    "make_plan",
    "plan_from_ratios",
    "run_sweep",
    "table_losses",
]
