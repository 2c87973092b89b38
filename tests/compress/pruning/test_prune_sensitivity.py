from __future__ import annotations

import io
import logging
from typing import Any

import pytest
import torch
import torch_pruning as tp

from slimline.compress.finetune import to_tensors
from slimline.compress.pruning import sensitivity
from slimline.compress.pruning.graph import PruneGraph
from slimline.compress.pruning.sensitivity import (
    SLOW_SWEEP_SECONDS,
    Evaluator,
    SweepEstimate,
    SweepSpec,
    run_sweep,
)
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


def _sweep(task: Task, **kw: object) -> dict[str, Any]:
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
    # the fixture's training numerics differ by CPU kind (0.895 and above seen); the sweep only
    # needs a model far above chance (0.1 on ten digits) so that pruning's damage shows
    assert table["base_metric"] > 0.5
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
    assert pooled["estimate"]["from_jobs"] == 4 and pooled["estimate"]["seconds"] > 0
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


class FakeClock:
    """Advances ``tick`` seconds at every reading."""

    def __init__(self, tick: float) -> None:
        self.tick, self.now = tick, -tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _estimate(jobs: int, parallel: int, clock: FakeClock) -> SweepEstimate:
    return SweepEstimate(jobs, parallel, backend="test", hint="HINT", clock=clock)


def test_a_long_sweep_is_estimated_from_its_first_two_waves_and_announced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(0.0)
    est = _estimate(167, 2, clock)
    for seconds in (30.0, 28.0, 13.0):  # the first wave warms up: it counts as time spent only
        est.finished({"seconds": seconds})
    assert est.seconds is None  # two waves of two workers: four jobs
    clock.now = 60.0
    with caplog.at_level(logging.INFO, logger="slimline.prune"):
        est.finished({"seconds": 11.0})
    assert est.seconds == pytest.approx(60.0 + 12.0 * 163 / 2)  # 1038 s
    assert est.message is not None and "167 jobs will take about 17 min" in est.message
    assert "12.0 s a job" in est.message
    assert "HINT" in est.message and est.message in caplog.text
    est.finished({"seconds": 50.0})  # later jobs do not move the announced estimate
    assert est.to_dict() == {
        "seconds": pytest.approx(1038.0),
        "from_jobs": 4,
        "job_seconds": 12.0,
        "limit_seconds": SLOW_SWEEP_SECONDS,
        "announced": est.message,
    }


def test_a_short_sweep_is_estimated_but_not_announced(caplog: pytest.LogCaptureFixture) -> None:
    est = _estimate(40, 1, FakeClock(2.0))
    with caplog.at_level(logging.WARNING, logger="slimline.prune"):
        est.finished({"seconds": 9.0})
        est.finished({"seconds": 2.0})
    assert est.seconds == pytest.approx(2.0 + 2.0 * 38)  # one tick since the start, 38 to go
    assert est.message is None and not caplog.text


def test_the_sweep_records_its_estimate_and_names_the_settings_that_shorten_it(
    digits: Task, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(40.0)  # every reading 40 s later: each job "takes" 40 s
    monkeypatch.setattr(sensitivity, "_clock", clock)
    graph, order, ev, spec = _setup(digits, limit=50)
    with caplog.at_level(logging.WARNING, logger="slimline.prune"):
        table = run_sweep(
            graph, order, ev, ratios=RATIOS, max_ratio=0.8, spec=spec, workers=1,
            ray_address=None, progress=False,
        )  # fmt: skip
    n = table["jobs"]
    assert n > 5  # clock readings: start, 2 per job, the estimate after job 2, the end
    assert table["estimate"]["seconds"] == pytest.approx(200.0 + 40.0 * (n - 2))
    assert table["seconds"] == pytest.approx(40.0 * (2 * n + 2))
    assert table["estimate"]["from_jobs"] == 2 and table["estimate"]["job_seconds"] == 40.0
    message = table["estimate"]["announced"]
    assert message and message in caplog.text and f"{n} jobs" in message
    for key in ("sensitivity_samples` (now 50 rows)", "`ratios` (now 3)", "`workers`", "`plan:`"):
        assert key in message
