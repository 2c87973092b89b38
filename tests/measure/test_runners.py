"""ONNX Runtime load failures: one line with the runtime's cause and node, blamed on the user only
for the user's own model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slimline.errors import CandidateError, ModelFileError
from slimline.measure.runners import check_candidate, ort_session


def _dq_with_axis_at_opset_12(path: Path) -> Path:
    """A per-channel DequantizeLinear (``axis``) in an opset-12 graph: ONNX Runtime refuses it."""
    inits = [
        numpy_helper.from_array(np.zeros(4, np.int8), "q"),
        numpy_helper.from_array(np.ones(4, np.float32), "scale"),
        numpy_helper.from_array(np.zeros(4, np.int8), "zero"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["w"], name="dq", axis=0),
            helper.make_node("Add", ["x", "w"], ["y"], name="add"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = 7
    onnx.save(model, path)
    return path


def test_a_candidate_onnx_runtime_refuses_names_the_cause_and_the_node(tmp_path: Path) -> None:
    path = _dq_with_axis_at_opset_12(tmp_path / "q.onnx")
    with pytest.raises(CandidateError) as info:
        ort_session(path, 1)
    msg = str(info.value)
    assert msg.startswith("ONNX Runtime cannot load q.onnx, a candidate slimline wrote: ")
    assert (
        "Unrecognized attribute: axis for operator DequantizeLinear (node dq (DequantizeLinear))"
        in msg
    )
    assert "\n" not in msg and len(msg) < 300 and "re-export" not in msg
    with pytest.raises(CandidateError, match=r"onnx.checker rejects q.onnx.*axis.*\(node dq "):
        check_candidate(path)


def test_the_users_model_is_blamed_only_when_it_is_the_users(tmp_path: Path) -> None:
    path = _dq_with_axis_at_opset_12(tmp_path / "model.onnx")
    with pytest.raises(
        ModelFileError, match=r"cannot load the model .*model\.onnx \(INVALID_GRAPH"
    ):
        ort_session(path, 1, user_model=True)
    with pytest.raises(ModelFileError, match="does not exist"):
        ort_session(tmp_path / "missing.onnx", 1, user_model=True)


def _layer_norm_at_opset_12(path: Path) -> Path:
    """LayerNormalization in the default domain of an opset 12 graph, as ONNX Runtime's
    extended optimizer writes it into PP-OCR's recognizer (ONNX's schema starts at opset 17)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])
    scale = numpy_helper.from_array(np.ones(4, np.float32), "scale")
    bias = numpy_helper.from_array(np.zeros(4, np.float32), "bias")
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=-1)
    graph = helper.make_graph([node], "g", [x], [y], initializer=[scale, bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = 7
    onnx.save(model, str(path))
    return path


def test_an_op_onnx_runtime_registers_before_onnx_does_passes_the_check(tmp_path: Path) -> None:
    path = _layer_norm_at_opset_12(tmp_path / "ln.onnx")
    with pytest.raises(onnx.checker.ValidationError, match="No Op registered"):
        onnx.checker.check_model(str(path))
    check_candidate(path)  # ONNX Runtime, which runs it, loads it
    out = ort_session(path, 1).run(None, {"x": np.arange(8, dtype=np.float32).reshape(2, 4)})[0]
    assert np.allclose(out.mean(axis=-1), 0.0, atol=1e-5)
