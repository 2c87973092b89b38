"""A compute node the precision plan keeps in float runs in float under ONNX Runtime: its weights
are not re-quantized per tensor at load time (ONNX Runtime's WeightBiasQuantization)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from quant_fixtures import batches, cnn_inputs

from slimline.compress.quant.calibrate import calibrate
from slimline.compress.quant.config import QuantSpec
from slimline.compress.quant.engine import quantize_model
from slimline.compress.quant.fallback import kernel_report
from slimline.compress.quant.float_inputs import float_inputs
from slimline.compress.quant.plan import resolve_plan
from slimline.compress.quant.prepare import prepare
from slimline.cpu import detect as detect_cpu
from slimline.measure.runners import ort_session

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane


def _optimized(path: Path, tmp: Path) -> onnx.GraphProto:
    out = tmp / f"{path.stem}-optimized.onnx"
    ort_session(path, 1, optimized_out=out, level="all")
    return onnx.load(str(out)).graph


def test_a_conv_kept_float_runs_float_with_its_float_weights(
    cnn_onnx: Path, tmp_path: Path
) -> None:
    prepared = prepare(cnn_onnx, tmp_path, cnn_inputs(0, 1))
    calib = calibrate(
        prepared.path, list(batches(cnn_inputs, 2, 16)), tmp_path, samples=32, methods={"minmax"}
    )
    middle = prepared.compute_nodes[2]  # fed by a quantized convolution's output
    plan = resolve_plan(prepared.compute_nodes, {middle: "float"}, keep_first_last_float=False)
    spec = QuantSpec("static", reduce_range=detect_cpu().u8s8_saturates)
    q = quantize_model(prepared.path, tmp_path / "q.onnx", spec, plan.float_nodes, calib.caches)

    report = kernel_report(q)
    assert report["int8_kernels"] == len(plan.int8_nodes) == 4
    assert report["kernels"].get("Conv", 0) + report["kernels"].get("FusedConv", 0) == 1
    graph = _optimized(q, tmp_path)
    producer = {o: n for n in graph.node for o in n.output}
    inits = {i.name: i for i in graph.initializer}
    convs = [n for n in graph.node if n.op_type in ("Conv", "FusedConv")]
    assert len(convs) == 1
    weight = convs[0].input[1]
    assert weight in inits and weight not in producer  # a float initializer, not dequantized
    assert inits[weight].data_type == TensorProto.FLOAT


def _qdq_conv_graph(channels: int, extra_consumer: bool) -> onnx.ModelProto:
    """x -> Q -> DQ -> Conv(float weight) -> Q -> DQ -> y [and DQ -> Relu when
    ``extra_consumer``]: the pattern ONNX Runtime quantizes float weights in at load time."""
    shape = [1, channels, 2, 2]
    inits = [
        numpy_helper.from_array(np.linspace(-1, 1, 2 * channels, dtype=np.float32), "w"),
        numpy_helper.from_array(np.array(0.02, np.float32), "s"),
        numpy_helper.from_array(np.array(128, np.uint8), "z"),
    ]
    inits[0].dims[:] = [2, channels, 1, 1]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xdq"], name="dq"),
        helper.make_node("Conv", ["xdq", "w"], ["c"], name="conv"),
        helper.make_node("QuantizeLinear", ["c", "s", "z"], ["cq"], name="qc"),
        helper.make_node("DequantizeLinear", ["cq", "s", "z"], ["y"], name="dqc"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 2, 2])]
    if extra_consumer:
        nodes.append(helper.make_node("Relu", ["xdq"], ["r"], name="relu"))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, shape))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], outputs, inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _weight_dequantized_at_load(model: onnx.ModelProto, tmp: Path) -> bool:
    """Whether ONNX Runtime's basic-level optimizations feed the Conv a dequantized weight."""
    path, out = tmp / "m.onnx", tmp / "m-basic.onnx"
    onnx.save(model, str(path))
    ort_session(path, 1, optimized_out=out, level="basic")
    graph = onnx.load(str(out)).graph
    producer = {o: n for n in graph.node for o in n.output}
    conv = next(n for n in graph.node if n.op_type == "Conv")
    return conv.input[1] in producer and producer[conv.input[1]].op_type == "DequantizeLinear"


@pytest.mark.parametrize("extra_consumer", [False, True])
def test_a_float_conv_reads_the_quantized_input_through_its_own_dequantize(
    extra_consumer: bool, tmp_path: Path
) -> None:
    model = _qdq_conv_graph(2, extra_consumer)
    assert _weight_dequantized_at_load(model, tmp_path)  # what the rewrite prevents
    assert float_inputs(model) == ["conv"]
    onnx.checker.check_model(model, full_check=True)
    producer = {o: n for n in model.graph.node for o in n.output}
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    dq = producer[conv.input[0]]
    assert dq.op_type == "DequantizeLinear" and dq.input[0] == "xq"
    assert next(a.i for a in dq.attribute if a.name == "axis") == 1
    assert ({"dq"} <= {n.name for n in model.graph.node}) == extra_consumer
    assert not _weight_dequantized_at_load(model, tmp_path)
    x = np.random.RandomState(0).uniform(-2.0, 2.0, (1, 2, 2, 2)).astype(np.float32)
    path = tmp_path / "fixed.onnx"
    onnx.save(model, str(path))
    sess = ort_session(path, 1, level="disable")
    xdq = (np.clip(np.rint(x / 0.02) + 128, 0, 255) - 128) * 0.02  # the same quantized input
    w = numpy_helper.to_array(model.graph.initializer[0]).reshape(2, 2)
    conv_out = np.einsum("oc,nchw->nohw", w, xdq)
    expected = (np.clip(np.rint(conv_out / 0.02) + 128, 0, 255) - 128) * 0.02
    np.testing.assert_allclose(sess.run(["y"], {"x": x})[0], expected, atol=1e-6)


def test_a_single_channel_float_conv_reads_the_unquantized_tensor(tmp_path: Path) -> None:
    model = _qdq_conv_graph(1, extra_consumer=False)
    assert float_inputs(model) == ["conv"]
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    assert conv.input[0] == "x"
    assert not _weight_dequantized_at_load(model, tmp_path)


def test_compute_ops_ptq_quantizes_around_compute_nodes_only(
    cnn_onnx: Path, tmp_path: Path
) -> None:
    prepared = prepare(cnn_onnx, tmp_path, cnn_inputs(0, 1))
    calib = calibrate(
        prepared.path, list(batches(cnn_inputs, 2, 16)), tmp_path, samples=32, methods={"minmax"}
    )
    plan = resolve_plan(prepared.compute_nodes, {}, keep_first_last_float=False)
    rr = detect_cpu().u8s8_saturates
    out = {}
    for ops in ("all", "compute"):
        spec = QuantSpec("static", reduce_range=rr, ops=ops)
        q = quantize_model(prepared.path, tmp_path / f"{ops}.onnx", spec, [], calib.caches)
        graph = onnx.load(str(q)).graph
        producer = {o: n for n in graph.node for o in n.output}
        out[ops] = {
            producer[n.input[0]].op_type
            for n in graph.node
            if n.op_type == "QuantizeLinear" and n.input[0] in producer
        }
        assert kernel_report(q)["int8_kernels"] == len(plan.int8_nodes)
    assert "Add" in out["all"] and "Add" not in out["compute"]
