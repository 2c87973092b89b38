"""A task whose model() returns one cached module: no step may change it (STYLE rule 14).

The recipe export -> prune -> graph runs on ``cached_model_task.py``, with the prune step forced
to be accepted (objective size, a generous budget) and forced to be rejected (a cosine budget no
pruned model meets), each from an empty cache and again resumed from the cache. Every time the
FP32 row must still match the FP32 reference outputs, the cached module must be bitwise what the
task built, and every later figure must equal that of the same recipe on a copy of the task that
builds a fresh module per call.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch

from slimline.candidate import module_hash
from slimline.compress.finetune import to_tensors
from slimline.compress.pruning import sensitivity
from slimline.compress.pruning import step as prune_mod
from slimline.compress.pruning.graph import apply_history
from slimline.compress.pruning.sensitivity import SweepSpec
from slimline.pipeline import Run, run_recipe
from slimline.recipe import recipe_from_dict
from slimline.task import load_task

TASK = Path(__file__).parents[2] / "fixtures" / "cached_model_task.py"
PRUNE = {
    "target": 0.6,
    "rounds": 1,
    "ratios": [0.5, 0.75],
    "workers": 1,
    "progress": False,
    "sensitivity_samples": 16,
    "finetune": {"steps": 4, "eval_every": 2, "val_batches": 1, "progress": False},
}
BUDGETS = {
    # the pruned ONNX file is about 0.3x of FP32's: smaller by far more than 5%
    "accepted": {"max_metric_drop": 1.0, "min_cosine": -1.0, "objective": "size", "min_gain": 0.05},
    # a pruned model's outputs are never identical to FP32's
    "rejected": {"max_metric_drop": 1.0, "min_cosine": 1.0, "objective": "size", "min_gain": 0.05},
}


def _recipe(task: Path, budget: dict[str, Any]) -> Any:
    return recipe_from_dict(
        {
            "name": "no-mutation",
            "task": str(task),
            "target": {"threads": 1},
            "budget": budget,
            "bench": {
                "rounds": 2,
                "runs_per_round": 100,
                "warmup": 1,
                "batch_sizes": [1],
                "throughput_min_seconds": 0.01,
                "peak_rss": False,
            },
            "steps": ["export", {"prune": PRUNE}, {"graph": {"level": "extended"}}],
        }
    )


def _fresh_module_copy(tmp: Path) -> Path:
    text = TASK.read_text()
    assert "FRESH_EACH_CALL = False" in text
    path = tmp / "fresh_model_task.py"
    path.write_text(text.replace("FRESH_EACH_CALL = False", "FRESH_EACH_CALL = True"))
    return path


def _prune_never_runs(*a: Any, **kw: Any) -> Any:
    raise AssertionError("the prune step ran again instead of restoring its cache entry")


@pytest.fixture(scope="module", params=sorted(BUDGETS))
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    budget = BUDGETS[request.param]
    base = tmp_path_factory.mktemp(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLIMLINE_CACHE", str(base / "cache"))
        out = {
            "fresh": run_recipe(_recipe(TASK, budget), base / "fresh", cache=base / "steps"),
            "control": run_recipe(
                _recipe(_fresh_module_copy(base), budget), base / "control", cache=base / "steps"
            ),
        }
        mp.setattr(prune_mod, "PruneGraph", _prune_never_runs)
        out["resumed"] = run_recipe(_recipe(TASK, budget), base / "resumed", cache=base / "steps")
    return {"expect": request.param, **out}


def _by_name(run: Run) -> dict[str, Any]:
    return {c.name: c for c in run.chain}


@pytest.mark.parametrize("how", ["fresh", "resumed"])
def test_the_prune_decision_is_the_forced_one(runs: dict[str, Any], how: str) -> None:
    prune = _by_name(runs[how])["prune"]
    assert prune.accepted is (runs["expect"] == "accepted"), prune.reason
    assert prune.meta["macs"]["removed"] >= 0.6  # it really pruned


@pytest.mark.parametrize("how", ["fresh", "resumed"])
def test_fp32_torch_still_matches_the_reference_outputs(runs: dict[str, Any], how: str) -> None:
    run = runs[how]
    fp32 = _by_name(run)["fp32-torch"].measurement
    assert fp32["fidelity"]["cosine_min"] == pytest.approx(1.0, abs=1e-6)
    assert fp32["fidelity"]["max_abs_err"] == pytest.approx(0.0, abs=1e-6)
    assert fp32["metric"]["value"] == run.reference.metric == 1.0  # labels come from the model


@pytest.mark.parametrize("how", ["fresh", "resumed"])
def test_the_cached_module_is_bitwise_as_the_task_built_it(runs: dict[str, Any], how: str) -> None:
    run = runs[how]
    task_module = run.task.module
    cached = task_module._CACHED
    assert cached is not None and run.task.model() is cached
    assert module_hash(cached) == run.hashes["model"]  # fingerprint taken as the run began
    state = cached.state_dict()
    built = task_module.BUILT_STATE
    assert list(state) == list(built)
    for name, tensor in state.items():
        assert tensor.dtype == built[name].dtype and torch.equal(tensor, built[name]), name
    assert not any(m.training for m in cached.modules())
    assert all(p.requires_grad and p.grad is None for p in cached.parameters())
    for m in cached.modules():
        assert not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks), m


@pytest.mark.parametrize("how", ["fresh", "resumed"])
def test_every_figure_equals_a_run_on_fresh_modules(runs: dict[str, Any], how: str) -> None:
    got, want = _by_name(runs[how]), _by_name(runs["control"])
    assert list(got) == list(want) == ["fp32-torch", "fp32-onnx", "prune", "graph"]
    for name, cand in want.items():
        g, w = got[name].measurement, cand.measurement
        assert g["metric"]["value"] == w["metric"]["value"], name
        assert g["fidelity"]["cosine_mean"] == pytest.approx(w["fidelity"]["cosine_mean"]), name
        assert got[name].accepted == cand.accepted, name


def test_a_sweep_worker_prunes_a_copy_of_the_tasks_module() -> None:
    """What a process-pool or Ray worker does: the task loaded again, its model() pruned to the
    input model's shape; the task's own module must stay whole."""
    task = load_task(str(TASK))
    assert task.model is not None
    example = task.sample_inputs(2)
    history = [["conv", True, list(range(16))]]
    pruned = apply_history(copy.deepcopy(task.model()), to_tensors(example), history)
    buf = io.BytesIO()
    torch.save(pruned.state_dict(), buf)
    spec = SweepSpec(str(TASK), None, history, buf.getvalue(), 8, 1, example)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("slimline.task.load_task", lambda *a: task)  # the worker's own load
        evaluator = sensitivity._rebuild(spec)
    conv = evaluator.model.get_submodule("conv")
    assert isinstance(conv, torch.nn.Conv2d) and conv.out_channels == 48
    cached = task.model()
    assert cached.conv.out_channels == 64 and task.model() is cached
    assert all(torch.equal(v, task.module.BUILT_STATE[k]) for k, v in cached.state_dict().items())
