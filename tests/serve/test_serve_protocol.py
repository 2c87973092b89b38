"""The v2 codec alone: every datatype round-trips through JSON and binary encodings."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from slimline.serve import FakeBackend, ServedModel, TensorSpec
from slimline.serve.protocol import (
    V2_TO_NP,
    InferRequest,
    ProtocolError,
    RequestedOutput,
    encode_response,
    parse_infer_request,
    validate_inputs,
)


def values(dtype: str) -> np.ndarray:
    if dtype == "bool":
        return np.array([[True, False, True]])
    return np.array([[0, 1, 100]], dtype=dtype)


@pytest.mark.parametrize("datatype", list(V2_TO_NP))
@pytest.mark.parametrize("binary", [False, True])
def test_every_datatype_round_trips(datatype: str, binary: bool) -> None:
    arr = values(V2_TO_NP[datatype])
    tensor: dict[str, Any] = {"name": "t", "shape": [1, 3], "datatype": datatype}
    if binary:
        tensor["parameters"] = {"binary_data_size": arr.nbytes}
        head = json.dumps({"inputs": [tensor]}).encode()
        req = parse_infer_request(head + arr.tobytes(), str(len(head)))
    else:
        tensor["data"] = arr.tolist()
        req = parse_infer_request(json.dumps({"inputs": [tensor]}).encode(), None)
    np.testing.assert_array_equal(req.inputs["t"], arr)
    assert req.inputs["t"].dtype == arr.dtype

    spec = [TensorSpec("t", arr.dtype.name, (None, 3))]
    model = ServedModel("m", FakeBackend(spec, spec, lambda t: t))
    out_req = InferRequest(None, {}, [RequestedOutput("t", binary)], False, None)
    body, headers = encode_response(model, out_req, {"t": arr})
    if binary:
        n = int(headers["Inference-Header-Content-Length"])
        doc = json.loads(body[:n])
        back = np.frombuffer(body[n:], dtype=arr.dtype).reshape(doc["outputs"][0]["shape"])
    else:
        doc = json.loads(body)
        back = np.array(doc["outputs"][0]["data"], dtype=arr.dtype).reshape(1, 3)
    assert doc["outputs"][0]["datatype"] == datatype
    np.testing.assert_array_equal(back, arr)


@pytest.mark.parametrize(
    ("tensor", "fragment"),
    [
        ({"name": "t", "shape": [1, 2], "datatype": "INT8", "data": [1, 300]}, "out of range"),
        ({"name": "t", "shape": [1, 2], "datatype": "INT32", "data": [1, 2.5]}, "whole numbers"),
        ({"name": "t", "shape": [1, 2], "datatype": "BOOL", "data": [1, 0]}, "true/false"),
        ({"name": "t", "shape": [1, 2], "datatype": "FP32", "data": [[1], [2, 3]]}, "ragged"),
        ({"name": "t", "shape": [1, True], "datatype": "FP32", "data": [1]}, "non-negative"),
        ({"name": "t", "shape": [2], "datatype": "FP32", "data": [1, None]}, "nulls"),
        ({"name": "t", "shape": [1], "datatype": "BYTES", "data": ["a"]}, "numeric tensors"),
        ({"name": "t", "shape": [1], "datatype": "FP32"}, "neither"),
        ({"name": "t", "shape": [1], "datatype": "FP32",
          "parameters": {"binary_data_size": 8}}, "needs 4"),
    ],
)  # fmt: skip
def test_bad_tensors_name_the_problem(tensor: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment) as info:
        parse_infer_request(json.dumps({"inputs": [tensor]}).encode(), None)
    assert info.value.status == 400 and "'t'" in str(info.value)


def test_leftover_binary_bytes_and_duplicate_inputs_are_rejected() -> None:
    head = json.dumps({"inputs": [{"name": "t", "shape": [1], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 4}}]}).encode()  # fmt: skip
    with pytest.raises(ProtocolError, match="unused"):
        parse_infer_request(head + b"\0" * 8, str(len(head)))
    dup = {"inputs": [{"name": "t", "shape": [1], "datatype": "FP32", "data": [1]}] * 2}
    with pytest.raises(ProtocolError, match="twice"):
        parse_infer_request(json.dumps(dup).encode(), None)


def test_validation_allows_any_batch_but_checks_fixed_dimensions() -> None:
    spec = [TensorSpec("t", "float32", (None, 3))]
    model = ServedModel("m", FakeBackend(spec, spec, lambda t: t))
    validate_inputs(model, {"t": np.zeros((5, 3), np.float32)}, max_batch=8, allow_nonfinite=False)
    with pytest.raises(ProtocolError, match="batch size 9"):
        validate_inputs(model, {"t": np.zeros((9, 3), np.float32)}, max_batch=8,
                        allow_nonfinite=False)  # fmt: skip
    inf = np.array([[1.0, np.inf, 0.0]], np.float32)
    validate_inputs(model, {"t": inf}, max_batch=8, allow_nonfinite=True)
    with pytest.raises(ProtocolError, match="NaN or Inf"):
        validate_inputs(model, {"t": inf}, max_batch=8, allow_nonfinite=False)


def test_non_finite_json_outputs_stay_non_finite() -> None:
    spec = [TensorSpec("t", "float32", (None, 2))]
    model = ServedModel("m", FakeBackend(spec, spec, lambda t: t))
    req = InferRequest(None, {}, None, False, None)
    body, _ = encode_response(model, req, {"t": np.array([[np.nan, np.inf]], np.float32)})
    data = json.loads(body)["outputs"][0]["data"]
    assert np.isnan(data[0]) and data[1] == np.inf
    body, _ = encode_response(model, req, {"t": np.array([[0.5, 2.0]], np.float32)})
    assert json.loads(body)["outputs"][0]["data"] == [0.5, 2.0]
