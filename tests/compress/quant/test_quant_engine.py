from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from quant_fixtures import batches, cnn_inputs, text_inputs

from slimline.compress.quant.calibrate import calibrate
from slimline.compress.quant.config import QuantSpec
from slimline.compress.quant.engine import quantize_model
from slimline.compress.quant.fallback import fallback_warning, kernel_report
from slimline.compress.quant.layerwise import error_statement, layer_errors
from slimline.compress.quant.plan import resolve_plan
from slimline.compress.quant.prepare import prepare
from slimline.cpu import detect as detect_cpu
from slimline.errors import StepError
from slimline.measure.quality import fidelity
from slimline.measure.runners import ort_session

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane


@pytest.fixture(scope="module")
def cnn(cnn_onnx: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("cnnq")
    prepared = prepare(cnn_onnx, out, cnn_inputs(0, 1))
    calib = calibrate(
        prepared.path,
        list(batches(cnn_inputs, 4, 16)),
        out,
        samples=64,
        methods={"minmax", "percentile"},
    )
    return prepared, calib, out


# U8S8 in the format this CPU runs without saturation: 7-bit weights on x86 without VNNI
# (ONNX Runtime's advice), full 8-bit weights elsewhere. Fidelity bounds below then hold on any CPU.
U8S8 = QuantSpec("static", reduce_range=detect_cpu().u8s8_saturates)


def _outputs(path: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    return np.asarray(ort_session(path, 1).run(None, inputs)[0], np.float32)


def test_prepare_folds_batchnorm_and_lists_compute_nodes(cnn) -> None:  # type: ignore[no-untyped-def]
    prepared, _, _ = cnn
    assert "BatchNormalization" not in prepared.ops
    assert [prepared.op_type[n] for n in prepared.compute_nodes] == ["Conv"] * 4 + ["Gemm"]
    assert not prepared.transformer and not prepared.matmul_heavy


def test_u8s8_per_channel_runs_every_quantized_conv_as_an_integer_kernel(cnn) -> None:  # type: ignore[no-untyped-def]
    prepared, calib, out = cnn
    plan = resolve_plan(prepared.compute_nodes, {}, keep_first_last_float=True)
    q = quantize_model(prepared.path, out / "u8s8.onnx", U8S8, plan.float_nodes, calib.caches)
    report = kernel_report(q)
    assert report["int8_kernels"] == len(plan.int8_nodes) == 3
    assert report["summary"] == "3 of 5 quantizable ops run INT8"
    assert report["fallback"] == [] and report["float_by_choice"] == 2
    assert fallback_warning("u8s8", report) is None
    x = cnn_inputs(7, 8)
    fid = fidelity(_outputs(q, x), _outputs(prepared.path, x), logits=True)
    # 0.99 is 20 dB of output SQNR; three per-channel INT8 convolutions (7-bit weights cost at
    # most 6 dB each) leave a tiny CNN far above it: the bound catches a broken scale, not noise
    assert (fid["cosine_mean"] or 0.0) > 0.99


def test_s8s8_fallback_is_detected_and_named(cnn) -> None:  # type: ignore[no-untyped-def]
    """With quantize_static's defaults (S8 activations and weights, per-tensor) ONNX Runtime leaves
    some Convs as float kernels between the Q/DQ pairs. The report must say so, and name them."""
    prepared, calib, out = cnn
    spec = QuantSpec("static", activation_type="int8", per_channel=False)
    q = quantize_model(prepared.path, out / "s8s8.onnx", spec, [], calib.caches)
    report = kernel_report(q)
    assert [f["node"] for f in report["fallback"]] == ["/c2/Conv", "/c3/Conv"], report
    assert report["summary"] == "3 of 5 quantizable ops run INT8"
    warning = fallback_warning("s8s8", report)
    assert warning is not None and "float kernels between Q/DQ pairs" in warning


def test_layerwise_error_is_high_sqnr_and_ranked(cnn) -> None:  # type: ignore[no-untyped-def]
    prepared, calib, out = cnn
    plan = resolve_plan(prepared.compute_nodes, {}, keep_first_last_float=True)
    q = quantize_model(prepared.path, out / "edges.onnx", U8S8, plan.float_nodes, calib.caches)
    rows = layer_errors(prepared.path, q, plan.int8_nodes, batches(cnn_inputs, 1, 8, seed=30), 8)
    assert {r["node"] for r in rows} == set(plan.int8_nodes)
    assert all(
        r["sqnr_db"] > 20 and r["cosine"] > 0.99 for r in rows
    )  # INT8 per-channel on a tiny CNN
    local = [r["local_sqnr_db"] for r in rows]
    assert local == sorted(local)  # worst own quantization first
    assert all(r["local_sqnr_db"] >= r["sqnr_db"] - 0.5 for r in rows)  # accumulated error is worse
    text = error_statement(rows)
    assert rows[0]["node"] in text and rows[0]["op_type"] in text
    # a bad range on /c2/Conv's input (the float /c1/Conv's output) makes /c2/Conv the worst node
    c2_input = next(
        n.input[0] for n in onnx.load(str(prepared.path)).graph.node if n.name == "/c2/Conv"
    )
    worse = layer_errors(
        prepared.path,
        _sabotaged(q, c2_input, out),
        plan.int8_nodes,
        batches(cnn_inputs, 1, 8, seed=30),
        8,
    )
    assert worse[0]["node"] == "/c2/Conv" and worse[0]["local_sqnr_db"] < min(local) - 10


def _sabotaged(q: Path, tensor: str, out: Path) -> Path:
    """Multiply one activation's scale by 40: that tensor loses most of its resolution."""
    m = onnx.load(str(q))
    scale = next(i for i in m.graph.initializer if i.name == f"{tensor}_scale")
    arr = onnx.numpy_helper.to_array(scale) * 40
    scale.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), scale.name))
    path = out / "sabotaged.onnx"
    onnx.save(m, str(path))
    return path


def test_dynamic_quantization_of_a_transformer(encoder_onnx: Path, tmp_path: Path) -> None:
    prepared = prepare(encoder_onnx, tmp_path, text_inputs(0, 1))
    assert prepared.transformer and prepared.matmul_heavy
    assert prepared.ops["Attention"] == 2 and prepared.ops["SkipLayerNormalization"] == 4
    plan = resolve_plan(prepared.compute_nodes, {}, keep_first_last_float=False)
    spec = QuantSpec("dynamic", reduce_range=detect_cpu().u8s8_saturates)
    q = quantize_model(prepared.path, tmp_path / "dyn.onnx", spec, [], None)
    report = kernel_report(q)
    assert report["kernels"].get("QAttention") == 2 and report["fallback"] == [], report
    assert report["int8_kernels"] == report["compute_kernels"]
    x = text_inputs(5, 4)
    fid = fidelity(_outputs(q, x), _outputs(encoder_onnx, x), logits=False)
    assert (fid["cosine_mean"] or 0.0) > 0.98
    rows = layer_errors(prepared.path, q, plan.int8_nodes, [text_inputs(9, 4)], 4)
    assert rows and all(r["sqnr_db"] is None or r["sqnr_db"] > 10 for r in rows)


def test_prepare_undoes_runtime_fusions(cnn_onnx: Path, tmp_path: Path) -> None:
    """A graph saved by ONNX Runtime's extended optimizer holds FusedConv; quantization needs Conv."""
    fused = tmp_path / "fused.onnx"
    ort_session(cnn_onnx, 1, optimized_out=fused, level="extended")
    assert any(n.op_type == "FusedConv" for n in onnx.load(str(fused)).graph.node)
    prepared = prepare(fused, tmp_path / "p", cnn_inputs(0, 1))
    assert "FusedConv" not in prepared.ops and prepared.ops.get("Conv") == 4
    assert any("FusedConv" in n for n in prepared.notes)


def test_a_model_with_nothing_quantizable_is_an_error(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x], [y])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(StepError, match="nothing to quantize"):
        prepare(path, tmp_path / "p", {"x": np.ones((1, 4), np.float32)})


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_compute_inside_if_subgraphs_is_named_as_the_reason(tmp_path: Path) -> None:
    """A model whose MatMul sits in an If branch (as silero-vad's does): the step fails with the
    reason, which does not tell the user to change a recipe."""
    w = onnx.numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])

    def branch(name: str) -> onnx.GraphProto:
        node = helper.make_node("MatMul", ["x", "w"], ["y"], name=f"{name}_mm")
        return helper.make_graph([node], name, [], [out])

    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    node = helper.make_node(
        "If", ["cond"], ["y"], name="if", then_branch=branch("then"), else_branch=branch("else")
    )
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])
    graph = helper.make_graph([node], "g", [x, cond], [out], initializer=[w])
    path = _save(graph, tmp_path / "if.onnx")
    sample = {"x": np.ones((1, 4), np.float32), "cond": np.array(True)}
    with pytest.raises(StepError, match="inside If subgraphs") as err:
        prepare(path, tmp_path / "p", sample)
    assert "2 MatMul" in str(err.value) and "recipe" not in str(err.value)


def test_an_already_quantized_model_is_named_as_the_reason(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.UINT8, ["b", 4])
    y = helper.make_tensor_value_info("y", TensorProto.INT32, ["b", 4])
    w = onnx.numpy_helper.from_array(np.eye(4, dtype=np.uint8), "w")
    node = helper.make_node("MatMulInteger", ["x", "w"], ["y"], name="mmi")
    path = _save(helper.make_graph([node], "g", [x], [y], initializer=[w]), tmp_path / "q.onnx")
    with pytest.raises(StepError, match=r"already quantized \(1 MatMulInteger\)"):
        prepare(path, tmp_path / "p", {"x": np.ones((1, 4), np.uint8)})


def test_preparation_writes_nothing_in_the_working_directory(
    cnn_onnx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Symbolic shape inference saves a temporary model (and its .data) in the current directory
    when it cannot infer every shape (onnxruntime.tools.symbolic_shape_infer); preparation runs it
    inside its own output folder and leaves the cwd as it was."""
    from onnxruntime.quantization import shape_inference

    real = shape_inference.quant_pre_process

    def leaves_temp_files(*args: Any, **kwargs: Any) -> None:
        Path("sym_shape_infer_temp.onnx").write_bytes(b"")  # what ONNX Runtime leaves there
        real(*args, **kwargs)

    monkeypatch.setattr(shape_inference, "quant_pre_process", leaves_temp_files)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    prepare(cnn_onnx, tmp_path / "p", cnn_inputs(0, 1))
    assert Path.cwd() == cwd
    assert list(cwd.iterdir()) == []


def _head_split_model(width: int, head_size: int) -> onnx.ModelProto:
    """x[N, S, width] @ W + b, reshaped to [N, S, -1, head_size] the way recent exports do."""
    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), "W"),
        onnx.numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), "b"),
        onnx.numpy_helper.from_array(np.array([0], np.int64), "i0"),
        onnx.numpy_helper.from_array(np.array([1], np.int64), "i1"),
        onnx.numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
        onnx.numpy_helper.from_array(np.array([head_size], np.int64), "hs"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["mm"], name="q/MatMul"),
        helper.make_node("Add", ["mm", "b"], ["q"], name="q/Add"),
        helper.make_node("Shape", ["x"], ["shp"], name="shape"),
        helper.make_node("Gather", ["shp", "i0"], ["n"], name="g0"),
        helper.make_node("Gather", ["shp", "i1"], ["s"], name="g1"),
        helper.make_node("Concat", ["n", "s", "minus1", "hs"], ["dims"], axis=0, name="cat"),
        helper.make_node("Reshape", ["q", "dims"], ["y"], name="split"),
    ]
    graph = helper.make_graph(
        nodes,
        "heads",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "S", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_head_counts_are_written_into_head_splitting_reshapes(tmp_path: Path) -> None:
    from slimline.compress.quant.prepare import explicit_head_counts

    model = _head_split_model(width=40, head_size=8)  # a pruned layer: 5 heads of 8
    before = tmp_path / "before.onnx"
    onnx.save(model, str(before))
    assert explicit_head_counts(model) == 1
    cat = next(n for n in model.graph.node if n.op_type == "Concat")
    heads = next(i for i in model.graph.initializer if i.name == cat.input[2])
    assert onnx.numpy_helper.to_array(heads).tolist() == [5]
    after = tmp_path / "after.onnx"
    onnx.save(model, str(after))
    x = {"x": np.random.default_rng(1).standard_normal((2, 3, 40)).astype(np.float32)}
    a, b = (ort_session(p, 1).run(None, x)[0] for p in (before, after))
    assert a.shape == (2, 3, 5, 8) and np.array_equal(a, b)
    assert explicit_head_counts(model) == 0  # nothing left to rewrite
    # a width the head size does not divide is left alone
    assert explicit_head_counts(_head_split_model(width=36, head_size=8)) == 0


def test_reduce_range_weights_and_int8_embedding_tables(encoder_onnx: Path, tmp_path: Path) -> None:
    from onnx import numpy_helper

    prepared = prepare(encoder_onnx, tmp_path, text_inputs(0, 1))
    plain = quantize_model(prepared.path, tmp_path / "d.onnx", QuantSpec("dynamic"), [], None)
    spec = QuantSpec("dynamic", reduce_range=True, embeddings=True)
    small = quantize_model(prepared.path, tmp_path / "e.onnx", spec, [], None)
    model = onnx.load(str(small))
    # 7-bit weights: ONNX Runtime's reduced S8 range is [-64, 64]
    int8 = [
        numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == TensorProto.INT8
    ]
    assert int8 and max(int(np.abs(a).max()) for a in int8) <= 64
    # the word table (100 x 64 floats) is stored in 8 bits: at least 3 bytes saved per entry
    assert "QEmbedLayerNormalization" in {n.op_type for n in model.graph.node}
    assert plain.stat().st_size - small.stat().st_size >= 3 * 100 * 64
    x = text_inputs(5, 4)
    fid = fidelity(_outputs(small, x), _outputs(encoder_onnx, x), logits=False)
    assert (fid["cosine_mean"] or 0.0) > 0.98  # the bound of the plain dynamic test above
