from __future__ import annotations

import io

import pytest
import torch
import torch_pruning as tp

from slimline.compress.finetune import to_tensors
from slimline.compress.pruning.graph import PruneGraph
from slimline.compress.pruning.sensitivity import Evaluator, SweepSpec, run_sweep
from slimline.task import Task

RATIOS = [0.2, 0.5, 0.8]
L2 = tp.importance.GroupMagnitudeImportance(p=2)


def _setup(
    task: Task, limit: int = 200
) -> tuple[PruneGraph, dict[str, list[int]], Evaluator, SweepSpec]:
    assert task.model is not None
    example_np = task.sample_inputs(2)
    graph = PruneGraph(task.model(), to_tensors(example_np))
    order = {n: graph.removal_order(n, L2) for n in graph.groups}
    buf = io.BytesIO()
    torch.save(graph.model.state_dict(), buf)
    spec = SweepSpec(task.source, None, [], buf.getvalue(), limit, 1, example_np)
    return graph, order, Evaluator(graph.model, task, limit, graph.example), spec


def _sweep(task: Task, **kw: object) -> dict:
    graph, order, ev, spec = _setup(task)
    opts = {
        "ratios": RATIOS,
        "max_ratio": 0.8,
        "spec": spec,
        "workers": 1,
        "ray_address": None,
        "progress": False,
        **kw,
    }
    return run_sweep(graph, order, ev, **opts)  # type: ignore[arg-type]


def test_in_process_sweep_measures_every_group_and_ratio(digits: Task) -> None:
    table = _sweep(digits)
    assert table["backend"] == "in-process" and table["samples"] == 200
    assert table["base_metric"] > 0.9
    for name, row in table["groups"].items():
        assert len(row["metric"]) == 3
        # removing 80% of a group's channels, untrained, must hurt more than removing 20%
        assert row["cosine"][2] < row["cosine"][0], name
        assert row["metric"][2] <= row["metric"][0] + 0.01, name
    # pruning alone leaves the unpruned model untouched
    assert table["jobs"] == sum(len(set(r["keep"])) for r in table["groups"].values())


def test_process_pool_gives_the_same_table(digits: Task) -> None:
    local = _sweep(digits)
    pooled = _sweep(digits, workers=2)
    assert pooled["backend"] == "process-pool(2)"
    for name, row in local["groups"].items():
        assert pooled["groups"][name]["metric"] == row["metric"]
        assert pooled["groups"][name]["cosine"] == pytest.approx(row["cosine"], abs=1e-5)


@pytest.mark.ray
def test_ray_cluster_gives_the_same_table(digits: Task) -> None:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        local = _sweep(digits)
        remote = _sweep(digits, ray_address="auto")
    finally:
        ray.shutdown()
    assert remote["backend"] == "ray(auto)"
    for name, row in local["groups"].items():
        assert remote["groups"][name]["metric"] == row["metric"]
