"""bench/onnx_torch.py: an ONNX depthwise CNN (PP-OCR's op set) as a torch.fx module that QAT can
train: the same outputs as ONNX Runtime, real Conv2d weights, fake quantization inserted."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

SOURCE = Path(__file__).resolve().parents[1] / "bench" / "onnx_torch.py"


@pytest.fixture(scope="module")
def onnx_torch() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("onnx_torch", SOURCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def _tiny_depthwise() -> onnx.ModelProto:
    """Stem conv + BN, a depthwise conv with hard-swish written as x * clip(x + 3, 0, 6) / 6, an
    SE gate (global pool, 1x1 conv, HardSigmoid), a learnable-affine Mul/Add, upsampling by
    Resize and ConvTranspose, Concat, Sigmoid head: opset 12, weights as Constant nodes (as
    paddle2onnx writes them)."""
    rng = np.random.default_rng(0)

    def f(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.3, shape).astype(np.float32)

    def pos(n: int) -> np.ndarray:
        return rng.uniform(0.5, 1.5, n).astype(np.float32)

    nodes = [
        _const("w0", f(8, 3, 3, 3)), _const("b0", f(8)),
        _const("s", pos(8)), _const("sh", f(8)), _const("m", f(8)), _const("v", pos(8)),
        _const("wd", f(8, 1, 3, 3)), _const("three", np.array(3.0, np.float32)),
        _const("zero", np.array(0.0, np.float32)), _const("six", np.array(6.0, np.float32)),
        _const("ws", f(8, 8, 1, 1)), _const("a", np.array([1.2], np.float32)),
        _const("c", np.array([0.1], np.float32)), _const("roi", np.zeros(0, np.float32)),
        _const("scales", np.array([1, 1, 2, 2], np.float32)), _const("wt", f(8, 4, 2, 2)),
        _const("bias4", f(1, 12, 1, 1)), _const("wh", f(1, 12, 1, 1)),
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("BatchNormalization", ["c0", "s", "sh", "m", "v"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("Conv", ["r", "wd"], ["dw"], group=8, pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["dw", "three"], ["d3"]),
        helper.make_node("Clip", ["d3", "zero", "six"], ["cl"]),
        helper.make_node("Mul", ["dw", "cl"], ["hm"]),
        helper.make_node("Div", ["hm", "six"], ["hs"]),
        helper.make_node("GlobalAveragePool", ["hs"], ["g"]),
        helper.make_node("Conv", ["g", "ws"], ["gs"]),
        helper.make_node("HardSigmoid", ["gs"], ["gate"], alpha=0.2, beta=0.5),
        helper.make_node("Mul", ["hs", "gate"], ["se"]),
        helper.make_node("Mul", ["a", "se"], ["af"]),
        helper.make_node("Add", ["af", "c"], ["aff"]),
        helper.make_node("Resize", ["aff", "roi", "scales"], ["up"], mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
        helper.make_node("ConvTranspose", ["aff", "wt"], ["upt"], strides=[2, 2]),
        helper.make_node("Concat", ["up", "upt"], ["cat"], axis=1),
        helper.make_node("Add", ["cat", "bias4"], ["cb"]),
        helper.make_node("Conv", ["cb", "wh"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["y"]),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "tiny_dw",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1, "h", "w"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


def test_the_converted_module_computes_what_onnx_runtime_computes(onnx_torch: ModuleType) -> None:
    model = _tiny_depthwise()
    module = onnx_torch.to_torch(model)
    x = np.random.default_rng(1).normal(0, 1, (2, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        got = module(torch.from_numpy(x)).numpy()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})[0]
    assert got.shape == want.shape == (2, 1, 16, 16)
    np.testing.assert_allclose(got, want, atol=1e-5)
    convs = [m for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 4 and convs[1].groups == 8  # the depthwise one
    assert all(p.requires_grad for p in module.parameters())  # trainable


def test_qat_inserts_fake_quantization_into_the_converted_module(onnx_torch: ModuleType) -> None:
    from slimline.compress.qat import fakequant as fq

    module = onnx_torch.to_torch(_tiny_depthwise())
    student = fq.prepare(module, {"x": torch.zeros(2, 3, 16, 16)}, fq.FakeQuantFormat())
    weights = [n for n, m in fq.fake_quant_modules(student).items() if fq._is_weight(m)]
    assert len(weights) == 4  # every Conv2d, the depthwise one included
    out = student(torch.zeros(2, 3, 16, 16))
    out.sum().backward()  # gradients flow through the fake quantization


def test_an_op_outside_the_set_is_named(onnx_torch: ModuleType) -> None:
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], name="sm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    with pytest.raises(ValueError, match=r"unsupported ONNX op Softmax \(node sm\)"):
        onnx_torch.to_torch(helper.make_model(graph))
