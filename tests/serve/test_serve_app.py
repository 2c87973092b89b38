"""The HTTP server end to end on real models, on ONNX Runtime and on OpenVINO: endpoints,
validation, metrics."""

from __future__ import annotations

import gzip
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from pydantic import SecretStr

from slimline.errors import ServeError
from slimline.serve import (
    BatcherConfig,
    DynamicBatcher,
    FakeBackend,
    ServedModel,
    ServeSettings,
    TensorSpec,
    load_served_models,
    run_in_thread,
)

X = np.array([[1.0, 2.0, 3.0, 4.0], [-1.0, 0.5, 0.0, 2.0]], dtype=np.float32)


def infer_body(
    x: np.ndarray, name: str = "x", datatype: str = "FP32", **extra: Any
) -> dict[str, Any]:
    return {
        "inputs": [{"name": name, "shape": list(x.shape), "datatype": datatype,
                    "data": x.ravel().tolist()}],
        **extra,
    }  # fmt: skip


@pytest.fixture(scope="module", params=["onnxruntime", "openvino"])
def server(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """The same server on each runtime: every test through ``client`` runs on both."""
    if request.param == "openvino":
        pytest.importorskip("openvino", reason="the openvino extra is not installed")
    models = load_served_models(
        [model_dir / "tiny.onnx", model_dir / "tokens.onnx", model_dir / "fixed.onnx"],
        threads=1,
        runtime=request.param,
    )
    settings = ServeSettings(
        port=0, batching=BatcherConfig(max_batch_size=8, max_queue_delay_ms=1.0),
        max_body_bytes=64 * 1024,
    )  # fmt: skip
    with run_in_thread(models, settings) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=10) as c:
        yield c


def test_health_and_server_metadata(client: httpx.Client) -> None:
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").json() == {"ready": True}
    meta = client.get("/v2").json()
    assert meta["name"] == "slimline" and "binary_tensor_data" in meta["extensions"]


def test_model_metadata_comes_from_the_model(client: httpx.Client) -> None:
    meta = client.get("/v2/models/tiny").json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert [o["name"] for o in meta["outputs"]] == ["logits", "probs"]
    tokens = client.get("/v2/models/tokens/versions/1").json()
    assert tokens["inputs"][0] == {"name": "ids", "datatype": "INT64", "shape": [-1, -1]}
    assert client.get("/v2/models/fixed").json()["inputs"][0]["shape"] == [2, 4]
    assert client.get("/v2/models/tiny/ready").json() == {"ready": True}


def test_unknown_model_and_version_are_404_naming_what_is_served(client: httpx.Client) -> None:
    r = client.post("/v2/models/nope/infer", json=infer_body(X))
    assert r.status_code == 404 and "tiny" in r.json()["error"]
    assert client.get("/v2/models/tiny/versions/7").status_code == 404


def test_json_inference_matches_the_model(client: httpx.Client, expected_logits: Any) -> None:
    r = client.post("/v2/models/tiny/infer", json=infer_body(X, id="req-1"))
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["model_name"] == "tiny" and doc["id"] == "req-1"
    logits = next(o for o in doc["outputs"] if o["name"] == "logits")
    assert logits["shape"] == [2, 3] and logits["datatype"] == "FP32"
    np.testing.assert_allclose(np.reshape(logits["data"], (2, 3)), expected_logits(X), rtol=1e-6)


def test_binary_inference_round_trips_bytes(client: httpx.Client, expected_logits: Any) -> None:
    header = {
        "inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32",
                    "parameters": {"binary_data_size": X.nbytes}}],
        "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
    }  # fmt: skip
    head = json.dumps(header).encode()
    r = client.post(
        "/v2/models/tiny/infer",
        content=head + X.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(head)),
                 "Content-Type": "application/octet-stream"},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    n = int(r.headers["Inference-Header-Content-Length"])
    doc = json.loads(r.content[:n])
    assert [o["name"] for o in doc["outputs"]] == ["logits"]
    out = np.frombuffer(r.content[n:], dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(out, expected_logits(X), rtol=1e-6)


def test_multi_input_model_with_free_sequence_length(client: httpx.Client) -> None:
    ids = [[1, 2, 3], [4, 5, 6]]
    mask = [[1, 1, 0], [1, 0, 0]]
    body = {"inputs": [
        {"name": "ids", "shape": [2, 3], "datatype": "INT64", "data": ids},
        {"name": "mask", "shape": [2, 3], "datatype": "INT64", "data": mask},
    ]}  # fmt: skip
    r = client.post("/v2/models/tokens/infer", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [3.0, 4.0]
    body["inputs"][1]["shape"] = [2, 2]
    body["inputs"][1]["data"] = [[1, 1], [1, 0]]
    r = client.post("/v2/models/tokens/infer", json=body)
    assert r.status_code == 400  # shared symbolic dimension 'S' must agree: a 400, not a 500
    assert "disagree on dimension 'S' (3 vs 2)" in r.json()["error"]


def test_fixed_batch_model_runs_requests_alone(client: httpx.Client) -> None:
    assert client.post("/v2/models/fixed/infer", json=infer_body(X)).status_code == 200
    r = client.post("/v2/models/fixed/infer", json=infer_body(X[:1]))
    assert r.status_code == 400 and "dimension 0 must be 2" in r.json()["error"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (infer_body(X, name="y"), "has no input 'y'"),
        (infer_body(X.astype(np.float64), datatype="FP64"), "takes FP32"),
        (infer_body(np.zeros((2, 5), np.float32)), "dimension 1 must be 4"),
        (infer_body(np.zeros((2, 4, 1), np.float32)), "2 dimensions"),
        (infer_body(np.zeros((9, 4), np.float32)), "max_batch_size"),
        ({"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [1.0] * 7}]},
         "needs 8 elements"),
        ({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                      "data": [1.0, "a", 2.0, 3.0]}]}, "list of numbers"),
        ({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                      "data": [1.0, float("nan"), 2.0, 3.0]}]}, "NaN or Inf"),
        ({"inputs": []}, "non-empty list"),
        ({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "TEXT", "data": [1]}]},
         "datatype 'TEXT' is unknown"),
        ({**infer_body(X), "outputs": [{"name": "nope"}]}, "no output 'nope'"),
    ],
)  # fmt: skip
def test_invalid_requests_are_400_naming_the_input(
    client: httpx.Client, body: dict[str, Any], fragment: str
) -> None:
    r = client.post("/v2/models/tiny/infer", content=json.dumps(body))
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]


def test_malformed_bodies_get_4xx(client: httpx.Client) -> None:
    url = "/v2/models/tiny/infer"
    assert client.post(url, content=b"{not json").status_code == 400
    assert client.post(url, content=b"[1, 2]").status_code == 400
    assert client.post(url, content=b"[" * 50_000).status_code == 400  # recursion bomb
    assert client.post(url, content=b"\xff\xfe").status_code == 400
    r = client.post(url, content=b"{}", headers={"Content-Type": "text/html"})
    assert r.status_code == 415
    r = client.post(url, content=b"{}", headers={"Inference-Header-Content-Length": "99"})
    assert r.status_code == 400
    r = client.post(url, content=b"{}", headers={"Content-Encoding": "br"})
    assert r.status_code == 415


def test_body_limit_is_413_including_inflated_bodies(client: httpx.Client) -> None:
    url = "/v2/models/tiny/infer"
    assert client.post(url, content=b" " * (65 * 1024)).status_code == 413
    bomb = gzip.compress(b" " * (1 << 20))  # 1 KiB on the wire, 1 MiB inflated
    r = client.post(url, content=bomb, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413
    ok = gzip.compress(json.dumps(infer_body(X)).encode())
    assert client.post(url, content=ok, headers={"Content-Encoding": "gzip"}).status_code == 200


def test_metrics_count_outcomes_batches_and_memory(client: httpx.Client) -> None:
    before = _metric(client, 'slimline_requests_total{model="tiny",outcome="ok"}')
    bad_before = _metric(client, 'slimline_requests_total{model="tiny",outcome="bad_request"}')
    for _ in range(3):
        client.post("/v2/models/tiny/infer", json=infer_body(X))
    client.post("/v2/models/tiny/infer", content=b"nope")
    assert _metric(client, 'slimline_requests_total{model="tiny",outcome="ok"}') == before + 3
    bad = _metric(client, 'slimline_requests_total{model="tiny",outcome="bad_request"}')
    assert bad == bad_before + 1
    text = client.get("/metrics").text
    assert _metric(client, 'slimline_batch_size_count{model="tiny"}') >= 3
    assert 'slimline_queue_depth{model="tiny"} 0.0' in text
    assert 'slimline_inflight_requests{model="tiny"} 0.0' in text
    assert "slimline_compute_duration_seconds_bucket" in text
    assert "slimline_queue_duration_seconds_bucket" in text
    assert "slimline_request_duration_seconds_bucket" in text
    assert _metric(client, "process_resident_memory_bytes") > 10e6


def _metric(client: httpx.Client, series: str) -> float:
    text = client.get("/metrics").text
    m = re.search(re.escape(series) + r" ([0-9.e+]+)", text)
    assert m, f"{series} not exposed"
    return float(m.group(1))


def test_openapi_describes_the_endpoints(client: httpx.Client) -> None:
    doc = client.get("/openapi.json").json()
    infer = doc["paths"]["/v2/models/{name}/infer"]["post"]
    assert "application/octet-stream" in infer["requestBody"]["content"]
    assert any(p["name"] == "X-Request-Timeout-Ms" for p in infer["parameters"])
    assert "InferenceRequest" in doc["components"]["schemas"]
    assert {"/v2/health/ready", "/v2/models/{name}/ready", "/v2"} <= set(doc["paths"])


# -- servers with fake backends: queue policy, warm-up, processing pools, auth ----------------
def fake_model(name: str = "fake", delay_s: float = 0.0, **kw: Any) -> ServedModel:
    spec_in = [TensorSpec("x", "float32", (None, 2))]
    spec_out = [TensorSpec("y", "float32", (None, 2))]
    backend = FakeBackend(spec_in, spec_out, lambda t: {"y": t["x"] + 1.0}, delay_s=delay_s)
    return ServedModel(name, backend, **kw)


def fake_body(rows: int = 1) -> dict[str, Any]:
    return infer_body(np.ones((rows, 2), np.float32))


def test_full_queue_is_503_with_retry_after_and_deadline_is_504() -> None:
    model = fake_model(delay_s=0.4)
    settings = ServeSettings(
        port=0, batching=BatcherConfig(max_batch_size=1, max_queue_size=1, timeout_ms=5000)
    )
    with run_in_thread([model], settings) as url, httpx.Client(base_url=url, timeout=10) as c:
        assert model.backend.batches == [1]  # type: ignore[attr-defined]  # warm-up ran size 1
        results: list[httpx.Response] = []
        threads = [
            threading.Thread(target=lambda: results.append(c.post("/v2/models/fake/infer",
                                                                  json=fake_body())))
            for _ in range(2)
        ]  # fmt: skip
        for t in threads:
            t.start()
            time.sleep(0.1)  # first runs, second waits in the queue
        t0 = time.perf_counter()
        r = c.post("/v2/models/fake/infer", json=fake_body())
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert time.perf_counter() - t0 < 0.2  # at once, not after the running batch
        for t in threads:
            t.join()
        assert [x.status_code for x in results] == [200, 200]
        r = c.post(
            "/v2/models/fake/infer", json=fake_body(), headers={"X-Request-Timeout-Ms": "50"}
        )
        assert r.status_code == 504
        rejected = 'slimline_requests_total{model="fake",outcome="rejected"} 1.0'
        timeout = 'slimline_requests_total{model="fake",outcome="timeout"} 1.0'
        text = c.get("/metrics").text
        assert rejected in text and timeout in text


def test_powers_of_two_and_the_largest_batch_are_warmed_up_before_ready() -> None:
    model = fake_model(delay_s=0.05)
    settings = ServeSettings(port=0, batching=BatcherConfig(max_batch_size=6))
    with run_in_thread([model], settings) as url:
        assert sorted(model.backend.batches) == [1, 2, 4, 6]  # type: ignore[attr-defined]
        assert httpx.get(url + "/v2/health/ready").status_code == 200


def test_a_dead_batcher_makes_the_server_unhealthy_and_answers_503_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_select(self: DynamicBatcher, first: Any) -> Any:
        raise RuntimeError("bug in batch formation")

    settings = ServeSettings(port=0, batching=BatcherConfig(timeout_ms=5000))
    with run_in_thread([fake_model()], settings) as url, httpx.Client(base_url=url) as c:
        assert c.get("/v2/health/live").json() == {"live": True}
        monkeypatch.setattr(DynamicBatcher, "_select", broken_select)  # warm-up is done
        t0 = time.perf_counter()
        r = c.post("/v2/models/fake/infer", json=fake_body(), timeout=10)
        assert time.perf_counter() - t0 < 2.0  # not the 5 s deadline's 504
        assert r.status_code == 503 and "batcher stopped" in r.json()["error"]
        assert "bug in batch formation" in r.json()["error"]
        live, ready = c.get("/v2/health/live"), c.get("/v2/health/ready")
        assert (live.status_code, live.json()) == (503, {"live": False})
        assert (ready.status_code, ready.json()) == (503, {"ready": False})
        model_ready = c.get("/v2/models/fake/ready")
        assert (model_ready.status_code, model_ready.json()) == (503, {"ready": False})
        assert c.post("/v2/models/fake/infer", json=fake_body()).status_code == 503


def test_slow_preprocessing_never_starves_inference() -> None:
    gate = threading.Event()

    def stuck_pre(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        gate.wait(10)
        return t

    slow = fake_model("slow", preprocess=stuck_pre)
    fast = fake_model("fast")
    settings = ServeSettings(port=0, processing_threads=1)
    with run_in_thread([slow, fast], settings) as url, httpx.Client(base_url=url) as c:
        blocked = threading.Thread(target=lambda: c.post("/v2/models/slow/infer", json=fake_body()))
        blocked.start()
        time.sleep(0.05)
        r = c.post("/v2/models/fast/infer", json=fake_body(), timeout=2)
        assert r.status_code == 200  # inference is not queued behind the stuck pre-processing
        gate.set()
        blocked.join()


def test_api_token_guards_everything_but_health() -> None:
    settings = ServeSettings(port=0, api_token=SecretStr("s3cret"))
    with run_in_thread([fake_model()], settings) as url, httpx.Client(base_url=url) as c:
        assert c.get("/v2/health/ready").status_code == 200
        r = c.post("/v2/models/fake/infer", json=fake_body())
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        wrong = {"Authorization": "Bearer s3cre"}
        assert c.post("/v2/models/fake/infer", json=fake_body(), headers=wrong).status_code == 401
        assert c.get("/metrics").status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        r = c.post("/v2/models/fake/infer", json=fake_body(), headers=good)
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2.0, 2.0]


def test_pre_and_post_processing_wrap_the_model() -> None:
    model = fake_model(
        preprocess=lambda t: {"x": t["x"] * 2.0},
        postprocess=lambda t: {"y": t["y"] + 100.0},
    )
    with run_in_thread([model], ServeSettings(port=0)) as url:
        r = httpx.post(url + "/v2/models/fake/infer", json=fake_body())
    assert r.json()["outputs"][0]["data"] == [103.0, 103.0]  # (1 * 2 + 1) + 100


def test_pre_processing_errors_on_user_data_are_400() -> None:
    def picky(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise ValueError("expected positive pixels")

    with run_in_thread([fake_model(preprocess=picky)], ServeSettings(port=0)) as url:
        r = httpx.post(url + "/v2/models/fake/infer", json=fake_body())
    assert r.status_code == 400 and "expected positive pixels" in r.json()["error"]


def test_a_model_failing_warm_up_stops_the_server_with_the_reason() -> None:
    def broken(_: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise RuntimeError("no kernel for this op")

    spec = [TensorSpec("x", "float32", (None, 2))]
    model = ServedModel("broken", FakeBackend(spec, spec, broken))
    server = run_in_thread([model], ServeSettings(port=0))
    with pytest.raises(ServeError, match=r"warm-up of model 'broken' failed \(no kernel"):
        server.__enter__()
