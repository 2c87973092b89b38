from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slimline.errors import CandidateError
from slimline.measure.opprofile import aggregate, kernel_events, profile_ops


def _model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.zeros(64, np.float32), "b"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
        helper.make_node("Add", ["h1", "b"], ["h2"], name="add"),
        helper.make_node("Relu", ["h2"], ["h3"], name="relu"),
        helper.make_node("MatMul", ["h3", "w2"], ["h4"], name="mm2"),
        helper.make_node("Sigmoid", ["h4"], ["y"], name="sig"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return path


@pytest.fixture
def inputs() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)}


def test_profile_matches_graph_ops_and_shares_sum_to_one(
    tmp_path: Path, inputs: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _model(tmp_path / "m.onnx")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.chdir(tmp_path)
    prof = profile_ops(path, inputs, threads=1, runs=7, level="disable")
    json.dumps(prof)
    graph_ops = Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    assert {r["op_type"]: r["count"] for r in prof["by_op_type"]} == {
        op: n * 7 for op, n in graph_ops.items()
    }
    assert {r["node"] for r in prof["by_node"]} == {"mm1", "add", "relu", "mm2", "sig"}
    assert all(r["count"] == 7 for r in prof["by_node"])
    assert sum(r["share"] for r in prof["by_op_type"]) == pytest.approx(1.0)
    assert sum(r["share"] for r in prof["by_node"]) == pytest.approx(1.0)
    for r in prof["by_op_type"]:
        assert r["mean_ms_per_run"] == pytest.approx(r["total_ms"] / 7, rel=1e-3)
    totals = [r["total_ms"] for r in prof["by_op_type"]]
    assert totals == sorted(totals, reverse=True)
    assert prof["total_ms_per_run"] == pytest.approx(sum(totals) / 7, rel=1e-3)
    assert prof["runs"] == 7 and prof["threads"] == 1
    # the trace is deleted: nothing left in the temp area or the working directory
    assert list(scratch.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "scratch"]


def test_profile_top_limits_rows(tmp_path: Path, inputs: dict[str, np.ndarray]) -> None:
    prof = profile_ops(
        _model(tmp_path / "m.onnx"), inputs, threads=1, runs=3, top=2, level="disable"
    )
    assert len(prof["by_op_type"]) == 2 and len(prof["by_node"]) == 2
    assert prof["op_types"] == 4 and prof["nodes"] == 5


def test_profile_missing_file(tmp_path: Path, inputs: dict[str, np.ndarray]) -> None:
    # the profiler runs on candidates slimline wrote: a missing one is not the user's file
    with pytest.raises(CandidateError, match="a candidate slimline wrote: the file does not exist"):
        profile_ops(tmp_path / "nope.onnx", inputs, threads=1)


def _ev(cat: str, name: str, ts: int, dur: int, op: str | None = None) -> dict[str, Any]:
    e = {"cat": cat, "name": name, "ts": ts, "dur": dur, "ph": "X"}
    if op:
        e["args"] = {"op_name": op}
    return e


def test_kernel_events_skip_warmup_and_aggregate_numbers() -> None:
    events = [
        _ev("Session", "session_initialization", 0, 50),
        # warm-up run
        _ev("Session", "model_run", 100, 100),
        _ev("Node", "a_kernel_time", 110, 90, "Conv"),
        _ev("Node", "a_fence_before", 105, 1, "Conv"),
        # two recorded runs
        _ev("Session", "model_run", 300, 40),
        _ev("Node", "a_kernel_time", 305, 30, "Conv"),
        _ev("Node", "b_kernel_time", 336, 10, "Relu"),
        _ev("Session", "model_run", 400, 40),
        _ev("Node", "a_kernel_time", 405, 20, "Conv"),
        _ev("Node", "c_kernel_time", 426, 10, "Conv"),
    ]
    kernels, wall_us = kernel_events(events, skip_runs=1)
    assert wall_us == 80
    assert [k["node"] for k in kernels] == ["a", "b", "a", "c"]
    agg = aggregate(kernels, runs=2, top=15)
    by_type = {r["op_type"]: r for r in agg["by_op_type"]}
    assert by_type["Conv"]["total_ms"] == pytest.approx(0.060)
    assert by_type["Conv"]["mean_ms_per_run"] == pytest.approx(0.030)
    assert by_type["Conv"]["share"] == pytest.approx(60 / 70)
    assert by_type["Conv"]["count"] == 3
    assert by_type["Relu"]["share"] == pytest.approx(10 / 70)
    by_node = {r["node"]: r for r in agg["by_node"]}
    assert by_node["a"]["total_ms"] == pytest.approx(0.050) and by_node["a"]["count"] == 2
    assert agg["total_ms_per_run"] == pytest.approx(0.035)


def test_a_slow_model_records_about_three_seconds_of_runs_never_under_the_floor() -> None:
    import time

    from slimline.measure.opprofile import PROFILE_MIN_RUNS, PROFILE_SECONDS, profile_runs

    calls: list[int] = []
    assert profile_runs(lambda: calls.append(1), 2, 7) == 7  # fast: the runs asked for
    assert len(calls) == 2  # the warm-up ran
    slow = PROFILE_SECONDS / PROFILE_MIN_RUNS * 2  # a run that fills the time in half the floor
    assert profile_runs(lambda: time.sleep(slow), 1, 50) == PROFILE_MIN_RUNS
    assert profile_runs(lambda: time.sleep(slow), 0, 50) == 50  # no warm-up: nothing timed
