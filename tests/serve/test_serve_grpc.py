"""The Open Inference Protocol over gRPC: the unmodified `tritonclient[grpc]` against the server,
sharing HTTP's batcher, queue policy, deadlines, token and metrics; status codes for bad input."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from pydantic import SecretStr
from tritonclient.utils import InferenceServerException

from slimline.serve import (
    BatcherConfig,
    FakeBackend,
    ServedModel,
    ServerHandle,
    ServeSettings,
    TensorSpec,
    load_served_models,
    serve_in_thread,
)
from slimline.serve.proto import grpc_predict_v2_pb2 as pb
from slimline.serve.proto import grpc_predict_v2_pb2_grpc as pb_grpc

X = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerHandle]:
    models = load_served_models([model_dir / "tiny.onnx", model_dir / "tokens.onnx"])
    settings = ServeSettings(
        port=0, grpc_port=0, batching=BatcherConfig(max_batch_size=8), max_body_bytes=64 * 1024
    )
    with serve_in_thread(models, settings) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> triton.InferenceServerClient:
    assert server.grpc_target is not None
    return triton.InferenceServerClient(server.grpc_target)


@pytest.fixture(scope="module")
def stub(server: ServerHandle) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    assert server.grpc_target is not None
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("tiny", "1")
    meta = client.get_model_metadata("tiny", as_json=True)
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert meta["versions"] == ["1"]
    server_meta = client.get_server_metadata(as_json=True)
    assert server_meta["name"] == "slimline" and "binary_tensor_data" in server_meta["extensions"]


def test_infer_with_raw_contents_matches_the_model(
    client: triton.InferenceServerClient, expected_logits: Callable[[np.ndarray], np.ndarray]
) -> None:
    inp = triton.InferInput("x", list(X.shape), "FP32")
    inp.set_data_from_numpy(X)
    outputs = [triton.InferRequestedOutput("logits"), triton.InferRequestedOutput("probs")]
    result = client.infer("tiny", [inp], outputs=outputs, request_id="r1")
    np.testing.assert_allclose(result.as_numpy("logits"), expected_logits(X), rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("probs").sum(axis=1), 1.0, rtol=1e-6)
    response = result.get_response()
    assert response.id == "r1" and response.model_version == "1"
    assert len(response.raw_output_contents) == 2


def test_int64_inputs_default_outputs_and_compression(client: triton.InferenceServerClient) -> None:
    ids = np.array([[5, 6, 7]], dtype=np.int64)
    mask = np.array([[1, 1, 0]], dtype=np.int64)
    inputs = [triton.InferInput("ids", [1, 3], "INT64"), triton.InferInput("mask", [1, 3], "INT64")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(mask)
    result = client.infer("tokens", inputs, compression_algorithm="gzip")
    np.testing.assert_array_equal(result.as_numpy("total"), [11.0])


def test_typed_contents_are_accepted(
    stub: pb_grpc.GRPCInferenceServiceStub, expected_logits: Callable[[np.ndarray], np.ndarray]
) -> None:
    request = pb.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[3, 4])
    tensor.contents.fp32_contents.extend(X.ravel().tolist())
    response = stub.ModelInfer(request)
    logits = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(3, 3)
    np.testing.assert_allclose(logits, expected_logits(X), rtol=1e-6)


def _raw_request(raw: list[bytes], shape: list[int], name: str = "x") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="tiny", raw_input_contents=raw)
    request.inputs.add(name=name, datatype="FP32", shape=shape)
    return request


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        (_raw_request([X.tobytes()[:-4]], [3, 4]), "'x': raw_input_contents holds 44 bytes"),
        (_raw_request([X.tobytes(), b""], [3, 4]), "raw_input_contents has 2 entries"),
        (_raw_request([X.tobytes()], [3, 4], name="y"), "no input 'y'"),
        (_raw_request([np.zeros((3, 5), "f4").tobytes()], [3, 5]), "input 'x' has shape [3, 5]"),
        (_raw_request([np.zeros((4100, 4), "f4").tobytes()], [4100, 4]), "input 'x' brings"),
    ],
    ids=["short-raw", "raw-count", "unknown-input", "shape", "oversize"],
)
def test_bad_requests_are_invalid_argument_naming_the_input(
    stub: pb_grpc.GRPCInferenceServiceStub, request_: pb.ModelInferRequest, says: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in info.value.details()
    assert stub.ServerLive(pb.ServerLiveRequest()).live  # the server stays up


def test_a_message_above_twice_the_limit_is_refused_by_grpc_and_the_server_stays_up(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    huge = np.zeros((9000, 4), "f4")  # 144 KB: above twice the 64 KiB body limit
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(_raw_request([huge.tobytes()], [9000, 4]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.ServerLive(pb.ServerLiveRequest()).live


def test_stream_infer_with_unchanged_tritonclient_answers_each_request_by_id(
    client: triton.InferenceServerClient, expected_logits: Callable[[np.ndarray], np.ndarray]
) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(3):
            inp = triton.InferInput("x", [1, 4], "FP32")
            inp.set_data_from_numpy(X[i : i + 1])
            client.async_stream_infer("tiny", [inp], request_id=f"r{i}")
        bad = triton.InferInput("y", [1, 4], "FP32")  # the model has no input y
        bad.set_data_from_numpy(X[:1])
        client.async_stream_infer("tiny", [bad], request_id="bad")
        inp = triton.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(X[:1])
        client.async_stream_infer("tiny", [inp], request_id="after")  # the stream goes on
        got = [answers.get(timeout=10) for _ in range(5)]
    finally:
        client.stop_stream()
    errors = [str(e) for r, e in got if e is not None]
    assert len(errors) == 1 and "INVALID_ARGUMENT" in errors[0]
    assert "has no input 'y'" in errors[0]
    results = {r.get_response().id: r for r, e in got if e is None}
    assert set(results) == {"r0", "r1", "r2", "after"}
    for i in range(3):
        logits = results[f"r{i}"].as_numpy("logits")
        np.testing.assert_allclose(logits, expected_logits(X[i : i + 1]), rtol=1e-6)


def test_unknown_model_is_not_found(client: triton.InferenceServerClient) -> None:
    inp = triton.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(X[:1])
    with pytest.raises(InferenceServerException) as info:
        client.infer("nope", [inp])
    assert info.value.status() == "StatusCode.NOT_FOUND" and "tiny" in info.value.message()


def test_grpc_requests_count_in_the_shared_metrics(
    server: ServerHandle, client: triton.InferenceServerClient
) -> None:
    def ok_count() -> float:
        text = httpx.get(server.url + "/metrics").text
        line = next(x for x in text.splitlines()
                    if x.startswith('slimline_requests_total{model="tiny",outcome="ok"}'))  # fmt: skip
        return float(line.split()[-1])

    before = ok_count()
    inp = triton.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(X[:1])
    client.infer("tiny", [inp])
    httpx.post(server.url + "/v2/models/tiny/infer", json={
        "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": X[0].tolist()}]
    }).raise_for_status()  # fmt: skip
    assert ok_count() == before + 2


# -- a slow fake model: queue policy, deadlines, the token --------------------------------
def _fake(delay_s: float) -> ServedModel:
    spec = [TensorSpec("x", "float32", (None, 2))]
    return ServedModel("fake", FakeBackend(spec, spec, lambda t: {"x": t["x"] + 1}, delay_s))


def _fake_input() -> list[triton.InferInput]:
    inp = triton.InferInput("x", [1, 2], "FP32")
    inp.set_data_from_numpy(np.ones((1, 2), np.float32))
    return [inp]


def test_full_queue_is_unavailable_and_deadline_is_deadline_exceeded() -> None:
    settings = ServeSettings(
        port=0, grpc_port=0,
        batching=BatcherConfig(max_batch_size=1, max_queue_size=1, timeout_ms=5000),
    )  # fmt: skip
    with serve_in_thread([_fake(0.4)], settings) as handle:
        client = triton.InferenceServerClient(str(handle.grpc_target))
        results: list[Any] = []
        threads = [threading.Thread(target=lambda: results.append(client.infer("fake", _fake_input())))
                   for _ in range(2)]  # fmt: skip
        for t in threads:
            t.start()
            time.sleep(0.1)  # the first runs, the second waits in the queue
        with pytest.raises(InferenceServerException) as full:
            client.infer("fake", _fake_input())
        assert full.value.status() == "StatusCode.UNAVAILABLE"
        for t in threads:
            t.join()
        assert len(results) == 2
        with pytest.raises(InferenceServerException) as late:
            client.infer("fake", _fake_input(), timeout=50_000)  # the protocol's µs parameter
        assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        time.sleep(0.5)  # let the running batch finish
        with pytest.raises(InferenceServerException) as late:
            client.infer("fake", _fake_input(), client_timeout=0.1)  # the gRPC deadline
        assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        text = httpx.get(handle.url + "/metrics").text
        assert 'slimline_requests_total{model="fake",outcome="rejected"} 1.0' in text
        assert 'slimline_requests_total{model="fake",outcome="timeout"}' in text


def test_api_token_guards_all_but_health() -> None:
    settings = ServeSettings(port=0, grpc_port=0, api_token=SecretStr("s3cret"))
    with serve_in_thread([_fake(0.0)], settings) as handle:
        client = triton.InferenceServerClient(str(handle.grpc_target))
        assert client.is_server_live() and client.is_server_ready()
        with pytest.raises(InferenceServerException) as info:
            client.infer("fake", _fake_input())
        assert info.value.status() == "StatusCode.UNAUTHENTICATED"
        result = client.infer("fake", _fake_input(), headers={"authorization": "Bearer s3cret"})
        np.testing.assert_array_equal(result.as_numpy("x"), [[2.0, 2.0]])
        request = pb.ModelInferRequest(model_name="fake", raw_input_contents=[b"\0" * 8])
        request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
        with grpc.insecure_channel(str(handle.grpc_target)) as channel:
            stream = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.RpcError) as refused:
                list(stream(iter([request])))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            (answer,) = stream(iter([request]), metadata=[("authorization", "Bearer s3cret")])
            assert answer.error_message == "" and answer.infer_response.model_name == "fake"
