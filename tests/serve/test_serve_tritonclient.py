"""Integration: the unmodified `tritonclient[http]` package against the server, JSON and binary."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from slimline.serve import BatcherConfig, ServeSettings, load_served_models, run_in_thread

X = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[triton.InferenceServerClient]:
    models = load_served_models([model_dir / "tiny.onnx", model_dir / "tokens.onnx"])
    settings = ServeSettings(port=0, batching=BatcherConfig(max_batch_size=8))
    with run_in_thread(models, settings) as url:
        yield triton.InferenceServerClient(url.removeprefix("http://"))


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("tiny", "1")
    meta = client.get_model_metadata("tiny")
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert client.get_server_metadata()["name"] == "slimline"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer(
    client: triton.InferenceServerClient,
    expected_logits: Callable[[np.ndarray], np.ndarray],
    binary: bool,
) -> None:
    inp = triton.InferInput("x", list(X.shape), "FP32")
    inp.set_data_from_numpy(X, binary_data=binary)
    outputs = [
        triton.InferRequestedOutput("logits", binary_data=binary),
        triton.InferRequestedOutput("probs", binary_data=binary),
    ]
    result = client.infer("tiny", [inp], outputs=outputs, request_id="r1")
    np.testing.assert_allclose(result.as_numpy("logits"), expected_logits(X), rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("probs").sum(axis=1), 1.0, rtol=1e-6)
    assert result.get_response()["id"] == "r1"


def test_infer_with_default_outputs_int64_inputs_and_compression(
    client: triton.InferenceServerClient,
) -> None:
    ids = np.array([[5, 6, 7]], dtype=np.int64)
    mask = np.array([[1, 1, 0]], dtype=np.int64)
    inputs = [triton.InferInput("ids", [1, 3], "INT64"), triton.InferInput("mask", [1, 3], "INT64")]
    inputs[0].set_data_from_numpy(ids, binary_data=True)
    inputs[1].set_data_from_numpy(mask, binary_data=False)
    result = client.infer("tokens", inputs, request_compression_algorithm="gzip")
    np.testing.assert_array_equal(result.as_numpy("total"), [11.0])


def test_errors_reach_the_client_with_their_message(client: triton.InferenceServerClient) -> None:
    inp = triton.InferInput("x", [1, 5], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 5), np.float32))
    with pytest.raises(InferenceServerException, match="dimension 1 must be 4") as info:
        client.infer("tiny", [inp])
    assert info.value.status() == "400"


def test_large_bodies_are_decoded_off_the_event_loop_correctly(
    client: triton.InferenceServerClient,
) -> None:
    ids = np.arange(30_000, dtype=np.int64).reshape(1, -1) % 7  # 2 x 240 KB: above the offload
    mask = (np.arange(30_000, dtype=np.int64).reshape(1, -1) % 2).astype(np.int64)
    inputs = [triton.InferInput("ids", [1, 30_000], "INT64"),
              triton.InferInput("mask", [1, 30_000], "INT64")]  # fmt: skip
    for inp, arr in zip(inputs, (ids, mask), strict=True):
        inp.set_data_from_numpy(arr, binary_data=True)
    result = client.infer("tokens", inputs)
    np.testing.assert_allclose(result.as_numpy("total"), [float((ids * mask).sum())])
