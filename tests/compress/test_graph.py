from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from slimline.compress.graph import GraphConfig, is_transformer, op_counts, optimize_graph
from slimline.measure.runners import OrtRunner


def _conv_bn_model(path: Path) -> None:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "scale"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "bias"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "mean"),
        numpy_helper.from_array(rng.uniform(0.5, 2, 8).astype(np.float32), "var"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["b"]),
        helper.make_node("Relu", ["b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "convbn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 16, 16])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_batchnorm_left_by_exporter_is_folded_and_outputs_match(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    _conv_bn_model(src)
    rec = optimize_graph(src, dst, GraphConfig(level="basic"), threads=1)
    assert rec["ops_before"]["BatchNormalization"] == 1
    assert "BatchNormalization" not in rec["ops_after"] and rec["batchnorm_folded"] == 1
    x = {"x": np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)}
    a, b = OrtRunner("a", src, 1).run(x), OrtRunner("b", dst, 1).run(x)
    np.testing.assert_allclose(a, b, atol=1e-4)


def test_transformer_detection() -> None:
    assert is_transformer({"MatMul": 12, "Softmax": 2, "LayerNormalization": 4})
    assert not is_transformer({"Conv": 20, "Relu": 20})
    assert not is_transformer({"MatMul": 2, "Softmax": 1})


def test_op_counts(tmp_path: Path) -> None:
    _conv_bn_model(tmp_path / "m.onnx")
    assert op_counts(tmp_path / "m.onnx") == {"BatchNormalization": 1, "Conv": 1, "Relu": 1}
