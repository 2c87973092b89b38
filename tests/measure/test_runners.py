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
