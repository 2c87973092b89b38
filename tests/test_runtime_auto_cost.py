"""What runtime auto does not measure twice: each ONNX file is evaluated once per runtime in a
run, and the final benchmark times only the (runtime, candidate) pairs that can be the pick."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

import slimline.pipeline as pipeline
from slimline.candidate import Candidate
from slimline.measure.quality import evaluate
from slimline.pick import pairs_of
from slimline.pipeline import final, measurement
from slimline.recipe import recipe_from_dict
from slimline.runtimes import pick_pair
from slimline.task import load_task

pytest.importorskip("openvino", reason="the openvino extra is not installed")


@pytest.fixture
def auto_run(tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path) -> pipeline.Run:
    """A runtime-auto run on the tiny task up to its first step (FP32 baselines, reference)."""
    raw = {**tiny_recipe, "target": {"threads": 1, "runtime": "auto"}, "steps": ["export"]}
    recipe = recipe_from_dict(raw)
    task = load_task(recipe.task, recipe.samples, recipe.eval_samples)
    return pipeline.start_run(recipe, task, tmp_path / "run", cache=cache)


@pytest.fixture
def evaluations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The runner name of every evaluation the pipeline runs."""
    seen: list[str] = []
    real = evaluate

    def counting(runner: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(runner.name)
        return real(runner, *args, **kwargs)

    monkeypatch.setattr(measurement, "evaluate", counting)
    return seen


def _copy_of(base: Candidate, name: str, tmp_path: Path, verdicts: dict[str, Any]) -> Candidate:
    assert base.onnx is not None
    path = tmp_path / f"{name}.onnx"
    shutil.copyfile(base.onnx, path)
    return Candidate(
        name, "graph", base.name, onnx=path, accepted=True, meta={"runtime_verdicts": verdicts}
    )


def test_an_onnx_file_is_evaluated_once_per_runtime(
    auto_run: pipeline.Run, evaluations: list[str], tmp_path: Path
) -> None:
    base = auto_run.baseline
    first = measurement.quality_of(auto_run, base, "onnxruntime")
    assert measurement.quality_of(auto_run, base, "onnxruntime") is first
    same_file = _copy_of(base, "copy", tmp_path, {})  # same bytes, another name: same outputs
    assert measurement.quality_of(auto_run, same_file, "onnxruntime") is first
    assert evaluations == ["fp32-onnx"]
    on_ov = measurement.quality_of(auto_run, base, "openvino")
    assert evaluations == ["fp32-onnx", "fp32-onnx"]
    assert on_ov.cosine_mean == pytest.approx(first.cosine_mean, abs=1e-4)


def test_the_final_benchmark_times_only_pairs_that_can_be_picked(
    auto_run: pipeline.Run, evaluations: list[str], tmp_path: Path
) -> None:
    base = auto_run.baseline
    timing = {"against": "fp32-onnx", "p50_ms": 1.0, "ratio": 1.02, "rounds": 4}
    kept_on_ort = _copy_of(
        base,
        "kept-on-ort",
        tmp_path,
        {
            "onnxruntime": {"accepted": True, "reason": "faster: ..."},
            "openvino": {"accepted": False, "reason": "slower than fp32-onnx", "timing": timing},
        },
    )
    failed_on_ov = _copy_of(
        base,
        "failed-on-ov",
        tmp_path,
        {
            "onnxruntime": {"accepted": True, "reason": "faster: ..."},
            "openvino": {"accepted": False, "reason": "failed: OpenVINO cannot load it: op X"},
        },
    )
    cands = [base, kept_on_ort, failed_on_ov]
    assert final._pairs_to_time(auto_run, cands) == {
        "fp32-onnx@onnxruntime",
        "fp32-onnx@openvino",
        "kept-on-ort@onnxruntime",
        "failed-on-ov@onnxruntime",
    }
    figures = final._measure_pairs(auto_run, cands)
    # every pair that can be picked is timed; one whose median could no longer fall below a
    # contender's may leave after fewer rounds, and the manifest says why
    # (the benchmark ends when one pair is left: that one then has the most rounds)
    stopped = auto_run.extra["measurement_conditions"].get("rounds_stopped", {})
    timed = [(n, "onnxruntime") for n in ("fp32-onnx", "kept-on-ort", "failed-on-ov")]
    rounds = {
        f"{n}@{rt}": figures[n]["runtimes"][rt]["latency_ms"]["rounds"]
        for n, rt in [*timed, ("fp32-onnx", "openvino")]
    }
    most = max(rounds.values())
    assert most == 4 or len(stopped) == len(rounds) - 1
    assert all(r == most or (1 <= r < most and k in stopped) for k, r in rounds.items())
    rejected = figures["kept-on-ort"]["runtimes"]["openvino"]
    assert "latency_ms" not in rejected and "throughput" not in rejected
    assert rejected["not_timed"].startswith("rejected on openvino") and rejected["judged"] == timing
    assert rejected["within_budget"] and rejected["fidelity"]["cosine_mean"] > 0.999
    assert figures["failed-on-ov"]["runtimes"]["openvino"] == {
        "failed": "OpenVINO cannot load it: op X"
    }
    # three files with the same bytes: one evaluation per runtime, final figures included
    assert len(evaluations) == 2
    for c in cands:
        c.measurement = figures[c.name]
    pairs = pairs_of(cands)
    assert {(p.runtime, p.candidate) for p in pairs} == {
        ("onnxruntime", "fp32-onnx"),
        ("openvino", "fp32-onnx"),
        ("onnxruntime", "kept-on-ort"),
        ("onnxruntime", "failed-on-ov"),
    }
    pick = pick_pair(pairs)
    assert pick is not None  # and the pick never left early
    assert f"{pick.candidate}@{pick.runtime}" not in stopped
    assert figures[pick.candidate]["runtimes"][pick.runtime]["latency_ms"]["rounds"] == most
