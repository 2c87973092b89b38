"""Signed activation Q/DQ pairs re-encoded as unsigned: the same values on ONNX Runtime, and a
file OpenVINO reads the way ONNX Runtime does on every CPU kind (without VNNI it reads NNCF's
signed pairs to noise, which is why NNCF's ONNX candidate gets this there)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from quant_fixtures import cnn_inputs

from slimline.compress.qdq_unsigned import unsigned_activations

pytestmark = pytest.mark.cpu_kinds


class _Rows:
    """ONNX Runtime's calibration reader over a few rows of the tiny CNN's inputs."""

    def __init__(self) -> None:
        self.rows = iter([cnn_inputs(i, 4) for i in range(4)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.rows, None)


def _signed_qdq(src: Path, dst: Path) -> Path:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    quantize_static(
        str(src),
        str(dst),
        _Rows(),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QInt8,  # signed activations, as NNCF's ONNX backend writes
        weight_type=QuantType.QInt8,
        per_channel=True,
        reduce_range=True,  # 7-bit weights, as NNCF's overflow fix writes them without VNNI
    )
    return dst


def _zero_points(model: onnx.ModelProto) -> dict[str, np.dtype]:
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return {
        n.name: inits[n.input[2]].dtype
        for n in model.graph.node
        if n.op_type == "QuantizeLinear" and n.input[0] not in inits
    }


def test_signed_activations_become_unsigned_with_the_same_outputs(
    cnn_onnx: Path, tmp_path: Path
) -> None:
    from slimline.candidate import Candidate
    from slimline.measure.runners import OrtRunner, make_runner

    signed = _signed_qdq(cnn_onnx, tmp_path / "s8s8.onnx")
    model = onnx.load(str(signed))
    before = _zero_points(model)
    weights_before = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8]
    assert before and set(before.values()) == {np.dtype(np.int8)}
    n = unsigned_activations(model)
    assert n == len(before)
    onnx.checker.check_model(model)
    assert set(_zero_points(model).values()) == {np.dtype(np.uint8)}
    # weights keep their signed encoding; the signed activation zero points are gone
    weights_after = {
        i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8
    }
    assert weights_after and weights_after < {i.name for i in weights_before}
    unsigned = tmp_path / "u8s8.onnx"
    onnx.save(model, str(unsigned))
    x = cnn_inputs(9, 8)
    a, b = OrtRunner("s", signed, 1).run(x), OrtRunner("u", unsigned, 1).run(x)
    # the same values: a runtime may only round its requantizations differently (on x86-avx2
    # the two files give identical outputs)
    np.testing.assert_allclose(b, a, rtol=0.0, atol=0.01 * float(np.abs(a).max()))
    ov = make_runner(Candidate("u", "quantize", None, onnx=unsigned), 1, None, "openvino").run(x)
    cos = (ov * b).sum(1) / np.linalg.norm(ov, axis=1) / np.linalg.norm(b, axis=1)
    assert float(cos.min()) > 0.99  # OpenVINO reads the unsigned file as ONNX Runtime does


def test_a_pair_read_by_anything_but_a_dequantize_stays_signed(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("q", TensorProto.INT8, [1, 4])
    scale = numpy_helper.from_array(np.array(0.1, np.float32), "s")
    zp = numpy_helper.from_array(np.array(0, np.int8), "zp")
    q = helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"])
    model = helper.make_model(helper.make_graph([q], "g", [x], [y], [scale, zp]))
    assert unsigned_activations(model) == 0  # its output is the graph's: its type is kept
    assert model.graph.node[0].input[2] == "zp"
