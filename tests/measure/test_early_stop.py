"""Stopping a parent-vs-candidate comparison early: only when no later round can change the
verdict, and the benchmark then reports the rounds it ran."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from slimline.candidate import Candidate
from slimline.measure.latency import (
    benchmark,
    cannot_be_faster,
    speed_verdict,
    summarize_latency,
    throughput_round_indices,
)
from slimline.recipe import BenchConfig


def _lat(per_round_p50: list[float]) -> dict[str, object]:
    return summarize_latency([np.full(9, v) + np.linspace(-0.01, 0.01, 9) for v in per_round_p50])


@pytest.mark.parametrize("rounds", [3, 4, 5, 6])
def test_a_stop_never_changes_the_verdict_all_rounds_would_give(rounds: int) -> None:
    rng = np.random.default_rng(rounds)
    gain, stops = 0.03, 0
    for _ in range(400):
        parent = list(rng.uniform(9.0, 11.0, rounds))
        cand = list(parent * rng.uniform(0.85, 1.15, rounds))
        for done in range(1, rounds + 1):
            if not cannot_be_faster(parent[:done], cand[:done], rounds, gain):
                continue
            stops += 1
            # whatever the remaining rounds give, even the candidate at a tenth of the parent
            best_case = cand[:done] + [p / 10 for p in parent[done:]]
            assert speed_verdict(_lat(parent), _lat(best_case), gain)[0] == "not faster"
            break
    assert stops > 50  # the rule does stop on slower candidates


def test_a_candidate_faster_in_half_the_rounds_is_not_stopped() -> None:
    parent = [10.0, 10.0, 10.0, 10.0, 10.0]
    cand = [11.0, 11.0, 9.0, 9.0]  # 2 misses of 5 planned rounds: round 5 can still decide
    assert not cannot_be_faster(parent[:4], cand, 5, 0.03)
    assert cannot_be_faster(parent[:3], [11.0, 11.0, 10.0], 5, 0.03)  # 3 of 5 miss the gain


def _identity_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_the_benchmark_stops_after_the_round_until_asks_for(tmp_path: Path) -> None:
    cands = [
        Candidate(name, "fp32", None, onnx=_identity_model(tmp_path / f"{name}.onnx"))
        for name in ("a", "b")
    ]
    bench = BenchConfig(rounds=5, runs_per_round=40, warmup=1, batch_sizes=[1])
    seen: list[int] = []

    def until(p50s: dict[str, list[float]]) -> bool:
        assert len(p50s["a"]) == len(p50s["b"])  # called after whole rounds only
        seen.append(len(p50s["a"]))
        return len(p50s["a"]) == 2

    out = benchmark(
        cands, {"x": np.ones((1, 4), np.float32)}, bench, 1, throughput=False, until=until
    )
    assert seen == [1, 2]
    assert out["a"]["latency_ms"]["rounds"] == out["b"]["latency_ms"]["rounds"] == 2
    assert len(out["a"]["latency_samples_ms"]) == 80


@pytest.mark.parametrize(
    ("rounds", "wanted", "expected"),
    [(5, 3, {0, 2, 4}), (5, 1, {0}), (3, 3, {0, 1, 2}), (2, 3, {0, 1}), (6, 2, {0, 5})],
)
def test_throughput_rounds_are_spread_from_first_to_last(
    rounds: int, wanted: int, expected: set[int]
) -> None:
    assert throughput_round_indices(rounds, wanted) == expected


def test_throughput_is_measured_in_its_rounds_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slimline.measure import latency

    calls: list[int] = []
    real = latency._throughput

    def counted(runner: object, batch: object, size: int, min_seconds: float) -> float:
        calls.append(size)
        return real(runner, batch, size, min_seconds)  # type: ignore[arg-type]

    monkeypatch.setattr(latency, "_throughput", counted)
    cands = [Candidate("a", "fp32", None, onnx=_identity_model(tmp_path / "a.onnx"))]
    bench = BenchConfig(
        rounds=5,
        runs_per_round=40,
        warmup=1,
        batch_sizes=[1, 4],
        throughput_min_seconds=0.001,
        throughput_rounds=2,
    )
    out = benchmark(cands, {"x": np.ones((4, 4), np.float32)}, bench, 1)
    assert out["a"]["latency_ms"]["rounds"] == 5  # latency in every round
    assert set(out["a"]["throughput"]) == {"1", "4"}
    assert all(v > 0 for v in out["a"]["throughput"].values())
    assert sorted(calls) == [1, 1, 4, 4]  # 2 rounds x 2 batch sizes, not 5 x 2
