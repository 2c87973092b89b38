from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slimline.errors import ModelFileError
from slimline.measure.distributions import (
    HEAVY_ABSMAX_OVER_STD,
    is_heavy,
    recommend_calibration,
    tensor_stats,
    weight_stats,
)


def _with_outliers(n: int = 10_000, k: int = 10, value: float = 100.0) -> np.ndarray:
    """+-1 alternating, then ``k`` values replaced by ``value``: exactly k outliers beyond 6 std."""
    a = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
    a[:k] = value
    return a.astype(np.float32)


def test_tensor_stats_counts_injected_outliers_exactly() -> None:
    a = _with_outliers()
    s = tensor_stats(a.reshape(100, 100))
    assert s["count"] == 10_000
    assert s["outlier_share"] == pytest.approx(10 / 10_000, abs=0)
    assert s["mean"] == pytest.approx(float(a.astype(np.float64).mean()))
    assert s["std"] == pytest.approx(float(a.astype(np.float64).std()))
    assert (s["min"], s["max"], s["absmax"]) == (-1.0, 100.0, 100.0)
    assert s["absmax_over_std"] == pytest.approx(100.0 / s["std"])
    expected = np.percentile(a.astype(np.float64), [0.1, 1, 50, 99, 99.9])
    got = [s["p0_1"], s["p1"], s["p50"], s["p99"], s["p99_9"]]
    assert got == pytest.approx(list(expected))
    assert is_heavy(s)


def test_tensor_stats_gaussian_has_no_outliers_and_is_not_heavy() -> None:
    a = np.random.default_rng(0).standard_normal(100_000)
    s = tensor_stats(a)
    assert s["outlier_share"] == 0.0
    assert 3.5 < s["absmax_over_std"] < HEAVY_ABSMAX_OVER_STD
    assert not is_heavy(s)
    json.dumps(s)


def test_tensor_stats_constant_and_empty() -> None:
    s = tensor_stats(np.full((3, 3), 2.5))
    assert (s["std"], s["absmax_over_std"], s["outlier_share"]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        tensor_stats(np.zeros((0,)))


def _stats(outlier_share: float, ratio: float) -> dict[str, float]:
    return {"outlier_share": outlier_share, "absmax_over_std": ratio}


def test_recommend_calibration_thresholds() -> None:
    calm = {f"t{i}": _stats(0.0, 4.0) for i in range(10)}
    assert recommend_calibration(calm)[0] == "minmax"
    # one heavy tensor of 10 is exactly the 10% threshold
    one_heavy = {**calm, "t0": _stats(0.0, 30.0)}
    method, reason = recommend_calibration(one_heavy)
    assert method == "percentile"
    assert "t0" in reason and "1 of 10" in reason
    # one of 11 is under 10%
    assert recommend_calibration({**one_heavy, "t10": _stats(0.0, 4.0)})[0] == "minmax"
    # outlier share alone makes a tensor heavy
    assert recommend_calibration([{"name": "a", **_stats(1e-4, 5.0)}])[0] == "percentile"
    assert recommend_calibration([{"name": "a", **_stats(0.9e-4, 5.0)}])[0] == "minmax"
    assert recommend_calibration({})[0] == "minmax"


def _model(path: Path) -> Path:
    w = _with_outliers(64 * 32).reshape(64, 32)
    w2 = np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32)
    bias = np.ones(32, np.float32)
    scale = np.linspace(0.5, 1.5, 8).astype(np.float32)
    shape = np.array([1, 8], np.int64)
    inits = [
        numpy_helper.from_array(w, "fc1.weight"),
        numpy_helper.from_array(bias, "fc1.bias"),
        numpy_helper.from_array(w2, "fc2.w"),
        numpy_helper.from_array(scale, "norm.weight"),
        numpy_helper.from_array(shape, "shape"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "fc1.weight"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "fc1.bias"], ["hb"], name="add1"),
        helper.make_node("MatMul", ["hb", "fc2.w"], ["o"], name="mm2"),
        helper.make_node("Mul", ["o", "norm.weight"], ["s"], name="scale"),
        helper.make_node("Reshape", ["s", "shape"], ["y"], name="reshape"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        inits,
    )
    onnx.save(helper.make_model(graph), path)
    return path


def test_weight_stats_from_onnx_initializers(tmp_path: Path) -> None:
    out = weight_stats(_model(tmp_path / "m.onnx"))
    json.dumps(out)
    layers = {r["name"]: r for r in out["layers"]}
    # 2-D float initializers and float tensors named *weight*; not 1-D biases nor int shapes
    assert set(layers) == {"fc1.weight", "fc2.w", "norm.weight"}
    fc1 = layers["fc1.weight"]
    assert fc1["shape"] == [64, 32]
    assert (fc1["consumer"], fc1["op_type"]) == ("mm1", "MatMul")
    assert fc1["outlier_share"] == pytest.approx(10 / 2048, abs=0)
    assert out["layers"][0]["name"] == "fc1.weight"  # worst first
    assert layers["norm.weight"]["min"] == pytest.approx(0.5)
    assert out["calibration_method"] == "percentile"
    assert out["recommendation"].startswith("percentile: 1 of 2 tensors")  # matrices only


def test_weight_stats_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelFileError):
        weight_stats(bad)
    with pytest.raises(ModelFileError):
        weight_stats(tmp_path / "missing.onnx")
