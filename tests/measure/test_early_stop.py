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
    warmed: list[bool] = []
    real = latency._throughput

    def counted(
        runner: object, batch: object, size: int, min_seconds: float, warm: bool = True
    ) -> float:
        calls.append(size)
        warmed.append(warm)
        return real(runner, batch, size, min_seconds, warm)  # type: ignore[arg-type]

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
    assert warmed == [True, True, False, False]  # a batch size is warmed in its first round only


@pytest.mark.parametrize("rounds", [5, 10, 15])
def test_a_settled_verdict_is_the_one_all_rounds_give(rounds: int) -> None:
    """settled_verdict in either direction: whatever the remaining rounds give (worst and best
    case both), speed_verdict over all of them says the same."""
    from slimline.measure.latency import settled_verdict

    rng = np.random.default_rng(rounds)
    gain, stops = 0.03, {"faster": 0, "not faster": 0}
    for _ in range(300):
        parent = list(rng.uniform(9.0, 11.0, rounds))
        cand = list(parent * rng.uniform(0.7, 1.15, rounds))
        for done in range(1, rounds):
            said = settled_verdict(parent[:done], cand[:done], rounds, gain)
            if said is None:
                continue
            stops[said] += 1
            for rest in (10.0, 0.1):  # the later rounds all far slower, then all far faster
                full = cand[:done] + [p * rest for p in parent[done:]]
                assert speed_verdict(_lat(parent), _lat(full), gain)[0] == said
                # and the verdict on the rounds run so far, which a stopped benchmark reports
                assert speed_verdict(_lat(parent[:done]), _lat(cand[:done]), gain)[0] == said
            break
    assert stops["not faster"] > 10
    assert stops["faster"] > 10 or rounds < 6  # 5 rounds: the sign test needs all 5 to win


def test_a_close_race_is_not_settled() -> None:
    from slimline.measure.latency import settled_verdict

    parent = [10.0] * 10
    cand = [9.0, 11.0] * 5  # half the rounds faster, half slower: no early answer
    assert all(settled_verdict(parent[:k], cand[:k], 15, 0.03) is None for k in range(1, 11))


@pytest.mark.parametrize("rounds", [3, 4, 5, 6])
def test_a_median_that_cannot_win_stays_lost(rounds: int) -> None:
    """median_cannot_win: whatever the later rounds give (the candidate's instant, FP32's
    endless), the candidate's median over all rounds, or over the rounds it ran, misses the
    gain against FP32's median over all rounds."""
    from slimline.measure.latency import median_cannot_win

    rng = np.random.default_rng(rounds)
    gain, stops = 0.03, 0
    for _ in range(400):
        base = list(rng.uniform(9.0, 11.0, rounds))
        cand = list(base * rng.uniform(0.9, 1.5, rounds))
        for done in range(1, rounds):
            if not median_cannot_win(base[:done], cand[:done], rounds, gain):
                continue
            stops += 1
            for later_base in (base[done:], [b * 50 for b in base[done:]]):
                full_base = base[:done] + later_base
                best = cand[:done] + [0.001] * (rounds - done)
                for c in (best, cand[:done]):
                    assert np.median(c) >= (1 - gain) * np.median(full_base)
            break
    assert stops > 50


def test_a_median_within_reach_is_timed_on() -> None:
    from slimline.measure.latency import median_cannot_win

    assert not median_cannot_win([10.0, 10.0], [10.5, 10.5], 5, 0.03)  # 3 rounds could win
    assert median_cannot_win([10.0, 10.0, 10.0], [12.0, 12.0, 12.0], 5, 0.03)
    assert not median_cannot_win([10.0] * 5, [12.0] * 5, 5, 0.03)  # all rounds run: no stop


def test_a_retired_candidate_is_left_out_of_later_rounds(tmp_path: Path) -> None:
    cands = [
        Candidate(name, "fp32", None, onnx=_identity_model(tmp_path / f"{name}.onnx"))
        for name in ("a", "b", "c")
    ]
    bench = BenchConfig(
        rounds=5, runs_per_round=40, warmup=1, batch_sizes=[1, 4], throughput_min_seconds=0.001
    )

    def retire(p50s: dict[str, list[float]]) -> list[str]:
        return ["b"] if len(p50s["a"]) >= 2 else []

    out = benchmark(cands, {"x": np.ones((4, 4), np.float32)}, bench, 1, retire=retire)
    assert out["a"]["latency_ms"]["rounds"] == out["c"]["latency_ms"]["rounds"] == 5
    assert out["b"]["latency_ms"]["rounds"] == 2
    assert len(out["b"]["latency_samples_ms"]) == 80

    def all_but_a(p50s: dict[str, list[float]]) -> list[str]:
        return ["b", "c"]

    out = benchmark(cands, {"x": np.ones((4, 4), np.float32)}, bench, 1, retire=all_but_a)
    assert {n: out[n]["latency_ms"]["rounds"] for n in "abc"} == {"a": 1, "b": 1, "c": 1}


def test_a_decisive_win_stops_early_and_a_close_one_does_not() -> None:
    from slimline.measure.latency import DECISIVE_ROUNDS, decisively_faster

    parent = [10.0, 10.4, 9.8, 10.1, 10.0]
    far = [4.6, 4.8, 4.5]  # 0.46x in every round, bands apart
    assert decisively_faster(parent[:3], far, 5, 0.03)
    assert not decisively_faster(parent[:2], far[:2], 5, 0.03)  # too few rounds yet
    assert DECISIVE_ROUNDS == 3
    # the rounds run give "faster" on their own (bands apart), as all rounds would here
    assert speed_verdict(_lat(parent[:3]), _lat(far), 0.03)[0] == "faster"
    close = [8.9, 9.0, 8.8]  # 0.89x: faster, but near the threshold: every round is run
    assert not decisively_faster(parent[:3], close, 5, 0.03)
    one_close = [4.6, 8.5, 4.5]  # one round near the threshold
    assert not decisively_faster(parent[:3], one_close, 5, 0.03)
    overlap = [4.6, 4.8, 10.5]
    assert not decisively_faster(parent[:3], overlap, 5, 0.03)
    assert not decisively_faster(parent, [4.6] * 5, 5, 0.03)  # the last round: nothing to skip


def test_a_pair_that_cannot_be_the_pick_leaves_the_final_benchmark() -> None:
    """The final benchmark's rule: a pair leaves once its median cannot fall below a contender's
    (eligible, within budget) whatever the later rounds give; never the pick, and never while
    the race is close."""
    from slimline.pipeline.final import out_of_the_race

    stopped: dict[str, str] = {}
    retire = out_of_the_race({"openvino:int8", "onnxruntime:fp32-onnx"}, 5, stopped)
    p50s = {
        "onnxruntime:fp32-onnx": [10.0, 10.3, 9.9],
        "openvino:fp32-onnx": [6.6, 6.9, 6.4],  # not a contender (say over budget), but slower
        "openvino:int8": [3.6, 3.8, 3.5],
        "onnxruntime:int8-over-budget": [3.0, 3.1, 2.9],  # faster, but cannot be the pick
    }
    out = set(retire(p50s))
    assert out == {"onnxruntime:fp32-onnx", "openvino:fp32-onnx"}
    assert stopped["openvino:fp32-onnx"].startswith("timed 3 of 5 rounds")
    assert "openvino:int8" in stopped["openvino:fp32-onnx"]
    # two rounds in: the bounds still overlap (the later rounds could reorder them)
    assert retire({k: v[:2] for k, v in p50s.items() if k not in stopped}) == []
    close = out_of_the_race({"a", "b"}, 5, {})
    assert close({"a": [3.6, 3.8, 3.5], "b": [3.7, 3.5, 3.6]}) == []


class _Sleeper:
    """A runner whose every run takes at least ``seconds``."""

    name = "sleeper"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        import time

        time.sleep(self.seconds)
        return np.zeros(1)

    def run_all(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": self.run(inputs)}


def test_a_decision_round_of_a_slow_model_runs_about_a_second_and_never_under_the_floor() -> None:
    """A model whose run takes 0.2 s gets the floor of runs per round in a decision benchmark
    (a round of 1 s would be 5 runs); a model that fits the configured runs in a second keeps
    them. The slowest runner sets the count for all."""
    from slimline.measure.latency import DECISION_MIN_RUNS, DECISION_ROUND_S, decision_runs

    x = {"x": np.zeros((1, 1), np.float32)}
    fast, slow = _Sleeper(0.0), _Sleeper(0.2)
    assert 0.2 * DECISION_MIN_RUNS > DECISION_ROUND_S  # the floor binds for the slow one
    assert decision_runs([("a", fast), ("b", slow)], x, 40) == DECISION_MIN_RUNS
    assert decision_runs([("a", fast)], x, 20) == 20
    assert decision_runs([("b", slow)], x, 10) == 10  # never more than configured


def test_reported_figures_of_a_slow_model_keep_the_floor_of_two_hundred_runs() -> None:
    """The final figures are reported, not decided: a slow model runs fewer than the configured
    runs per round, but never fewer than REPORT_MIN_RUNS over the rounds (the README's p99
    floor); a model whose configured runs fit REPORT_ROUND_S keeps them. Run times come from
    the warm-up (``took``), as in a benchmark."""
    from slimline.measure.latency import REPORT_MIN_RUNS, REPORT_ROUND_S, report_runs

    x = {"x": np.zeros((1, 1), np.float32)}
    fast, slow = _Sleeper(0.0), _Sleeper(0.0)
    bench = BenchConfig(rounds=5, runs_per_round=60)
    assert REPORT_ROUND_S < 0.045 * 60  # a 45 ms model's configured round is too long
    runs = report_runs([("a", fast), ("b", slow)], x, bench, {"a": 0.001, "b": 0.045})
    assert runs == REPORT_MIN_RUNS // 5 and runs * bench.rounds >= REPORT_MIN_RUNS
    assert report_runs([("a", fast)], x, bench, {"a": 0.001}) == 60
    three = BenchConfig(rounds=3, runs_per_round=100)
    assert report_runs([("b", slow)], x, three, {"b": 0.2}) == 67  # ceil(200 / 3)


class _Counter(_Sleeper):
    """A sleeping runner that counts its calls."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.calls = 0

    def run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        self.calls += 1
        return super().run(inputs)


def test_a_throughput_call_longer_than_the_minimum_is_one_sample() -> None:
    """A call that outlasts ``throughput_min_seconds`` is timed once, after one untimed call the
    first time the size is met and none after; short calls repeat until the minimum is filled."""
    from slimline.measure.latency import _throughput

    x = {"x": np.zeros((8, 1), np.float32)}
    slow = _Counter(0.05)
    assert 0 < _throughput(slow, x, 8, 0.02, warm=True) <= 8 / 0.05
    assert slow.calls == 2  # the warm-up and one timed call
    _throughput(slow, x, 8, 0.02, warm=False)
    assert slow.calls == 3
    fast = _Counter(0.0)
    _throughput(fast, x, 8, 0.02, warm=False)
    assert fast.calls > 1  # sleep(0) calls fill the 20 ms with many
