from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from slimline.compress.pruning.graph import CostModel, PruneGraph, keep_units
from slimline.compress.pruning.planner import check_reachable, make_plan, plan_from_ratios
from slimline.compress.pruning.sensitivity import table_losses
from slimline.errors import RecipeError

RATIOS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]


class Mlp(nn.Module):
    """Three equal hidden layers: each group costs the same, so sensitivity alone decides."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.h1 = nn.Linear(64, 64)
        self.h2 = nn.Linear(64, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> Any:
        return self.out(torch.relu(self.h2(torch.relu(self.h1(torch.relu(self.inp(x)))))))


@pytest.fixture
def setup() -> tuple[PruneGraph, CostModel]:
    torch.manual_seed(0)
    g = PruneGraph(Mlp().eval(), {"x": torch.randn(2, 32)}, keep_first_last=False)
    return g, CostModel(g)


def _table(g: PruneGraph, drop_per_ratio: dict[str, float]) -> dict[str, Any]:
    """A synthetic sensitivity table: metric falls linearly with the ratio, at per-group slopes."""
    groups = {}
    for name, grp in g.groups.items():
        keeps = [keep_units(grp.size, r, grp.kind, 8, 0.8) for r in RATIOS]
        groups[name] = {
            "kind": grp.kind,
            "size": grp.size,
            "keep": keeps,
            "metric": [0.9 - drop_per_ratio[name] * (1 - k / grp.size) for k in keeps],
            "cosine": [1.0] * len(keeps),
        }
    return {"ratios": RATIOS, "base_metric": 0.9, "groups": groups}


def test_plan_spares_sensitive_groups_and_meets_the_target(
    setup: tuple[PruneGraph, CostModel],
) -> None:
    g, cost = setup
    assert set(g.groups) == {"inp", "h1", "h2"}
    table = _table(g, {"inp": 0.01, "h1": 0.5, "h2": 0.02})
    plan = make_plan(
        g.groups, table, table_losses(table, 1.0), cost, target=0.3, by="macs", max_ratio=0.8
    )
    assert plan.removed >= 0.3
    assert plan.ratios["h1"] == 0.0 and plan.ratios["inp"] > 0.0  # the sensitive group is spared
    uniform = plan_from_ratios(
        g.groups, dict.fromkeys(g.groups, 0.2), cost, by="macs", max_ratio=0.8, round_to=8
    )
    assert uniform.removed >= 0.3  # a uniform plan reaches the target too, at a higher loss:
    assert plan.predicted_loss is not None and plan.predicted_loss < 0.5 * 0.25
    assert all(r <= 0.8 for r in plan.ratios.values())
    # the predicted cost is what pruning to the plan really gives
    macs, _ = cost.cost({n: k / g.groups[n].size for n, k in plan.keep.items()})
    assert 1 - macs / cost.total_macs == pytest.approx(plan.removed)


def test_plan_by_params_and_no_overshoot(setup: tuple[PruneGraph, CostModel]) -> None:
    g, cost = setup
    table = _table(g, {"inp": 0.1, "h1": 0.1, "h2": 0.1})
    plan = make_plan(
        g.groups, table, table_losses(table, 1.0), cost, target=0.2, by="params", max_ratio=0.8
    )
    assert 0.2 <= plan.removed < 0.35
    # walking back any one group by one level would miss the target
    for name, keep in plan.keep.items():
        if keep < g.groups[name].size:
            looser = {**plan.keep, name: keep + 8}
            _, params = cost.cost({n: k / g.groups[n].size for n, k in looser.items()})
            assert 1 - params / cost.total_params < 0.2 or table_losses(table, 1.0)[name][0] == 0


def test_unreachable_target_names_the_best_reachable_ratio(
    setup: tuple[PruneGraph, CostModel],
) -> None:
    g, cost = setup
    best = check_reachable(cost, g.groups, target=0.3, by="macs", max_ratio=0.8, round_to=8)
    assert 0.3 < best < 1.0
    with pytest.raises(RecipeError, match=rf"at most {best:.1%} can be removed.*set `target` to"):
        check_reachable(cost, g.groups, target=0.95, by="macs", max_ratio=0.8, round_to=8)


def test_losses_are_monotone_and_include_fidelity() -> None:
    table = {
        "base_metric": 0.9,
        "groups": {"a": {"metric": [0.9, 0.85, 0.88, 0.7], "cosine": [1.0, 0.9, 0.99, 0.5]}},
    }
    losses = table_losses(table, 0.5)["a"]
    assert losses == sorted(losses)
    assert losses[1] == pytest.approx(0.05 + 0.5 * 0.1)
    assert losses[3] == pytest.approx(0.2 + 0.5 * 0.5)


def test_plan_from_ratios_validates_names_and_cap(setup: tuple[PruneGraph, CostModel]) -> None:
    g, cost = setup
    plan = plan_from_ratios(g.groups, {"h1": 0.5}, cost, by="macs", max_ratio=0.8, round_to=8)
    assert plan.keep == {"inp": 64, "h1": 32, "h2": 64} and plan.removed > 0
    with pytest.raises(RecipeError, match=r"unknown groups \['nope'\].*prunable groups are"):
        plan_from_ratios(g.groups, {"nope": 0.5}, cost, by="macs", max_ratio=0.8, round_to=8)
    with pytest.raises(RecipeError, match="outside"):
        plan_from_ratios(g.groups, {"h1": 0.9}, cost, by="macs", max_ratio=0.8, round_to=8)
