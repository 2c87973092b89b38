"""A convolution's separate per-channel bias Add folded into it before QAT's conversion
(compress/qat/onnx_fold.py): exact, and only where the Add adds per channel to its one consumer."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from slimline.compress.qat.onnx_fold import fold_conv_bias


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((4, 4, 1, 1)).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(np.arange(4, dtype=np.float32), "b"),
        numpy_helper.from_array(np.array([1, 4, 1, 1], dtype=np.int64), "shape"),
        numpy_helper.from_array(np.ones(3, dtype=np.float32), "row"),  # adds along W: no bias
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["b", "shape"], ["b4"]),
        helper.make_node("Add", ["c1", "b4"], ["a1"]),  # folded: per channel, one consumer
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"]),
        helper.make_node("Add", ["c2", "b4"], ["a2"]),  # not folded: c2 has two consumers
        helper.make_node("Mul", ["c2", "a2"], ["m"]),
        helper.make_node("Conv", ["m", "w2"], ["c3"]),
        helper.make_node("Add", ["c3", "row"], ["y"]),  # not folded: not per channel
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 3, 3])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out: np.ndarray = sess.run(None, {"x": x})[0]
    return out


def test_only_a_per_channel_add_with_one_consumer_folds_and_the_outputs_stay() -> None:
    model = _model()
    folded = fold_conv_bias(model)
    adds = [n for n in folded.graph.node if n.op_type == "Add"]
    assert [n.output[0] for n in adds] == ["a2", "y"]  # a1 is now the first conv's output
    first = folded.graph.node[0]
    assert first.op_type == "Conv" and first.output[0] == "a1" and first.input[2]
    assert sum(n.op_type == "Add" for n in model.graph.node) == 3  # the input is left as it was
    x = np.random.default_rng(1).standard_normal((1, 3, 3, 3)).astype(np.float32)
    np.testing.assert_allclose(_run(folded, x), _run(model, x), rtol=1e-5, atol=1e-5)
