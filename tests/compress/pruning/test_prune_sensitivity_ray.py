"""The Ray backend of the sensitivity sweep never leaves its actors running, even on failure."""

from __future__ import annotations

import io
import time

import pytest
import torch

from slimline.compress.pruning.sensitivity import Job, SweepEstimate, SweepSpec, _ray
from slimline.task import Task

pytestmark = pytest.mark.ray


def test_a_failing_ray_sweep_still_kills_its_actors(
    digits: Task, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray = pytest.importorskip("ray")
    from ray import util

    held: list[object] = []

    class HoldingPool(util.ActorPool):  # keeps the handles alive: only an explicit kill ends them
        def __init__(self, actors: list[object]) -> None:
            held.extend(actors)
            super().__init__(actors)

    monkeypatch.setattr(util, "ActorPool", HoldingPool)
    assert digits.model is not None
    state = io.BytesIO()
    torch.save(digits.model().state_dict(), state)
    spec = SweepSpec(digits.source, None, [], state.getvalue(), 20, 1, digits.sample_inputs(2))
    jobs = [Job("g", 1, "no_such_layer", (0,)), Job("g", 2, "no_such_layer", (1,))]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(Exception, match="no_such_layer"):  # a job fails inside an actor
            _ray(spec, jobs, "auto", SweepEstimate(len(jobs), 2, backend="ray", hint=""))
        assert ray.is_initialized()  # the caller's own connection is left alone
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(held) == 2
        assert ray.available_resources().get("CPU", 0) == 2  # both actors are gone
    finally:
        ray.shutdown()
