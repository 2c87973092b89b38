"""Ray Serve scale-out: two replicas on a local Ray instance keep the same v2 endpoints."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from slimline.serve import BatcherConfig, ServeSettings

pytestmark = pytest.mark.ray

X = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_url(model_dir: Path) -> Iterator[str]:
    ray = pytest.importorskip("ray")
    from ray import serve

    from slimline.serve.ray import build_ray_app

    port = free_port()
    for attempt in (1, 2):  # Ray's own controller can die while starting on a loaded machine
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            break
        except ray.exceptions.RayActorError:
            ray.shutdown()
            if attempt == 2:
                raise
    try:
        settings = ServeSettings(batching=BatcherConfig(max_batch_size=4), threads=1)
        app = build_ray_app([model_dir / "tiny.onnx"], settings, replicas=2, cpus_per_replica=0.5)
        serve.run(app, name="slimline", route_prefix="/")
        status = serve.status().applications["slimline"].deployments["slimline"]
        assert status.replica_states.get("RUNNING") == 2  # type: ignore[call-overload]
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


def test_two_replicas_serve_the_v2_endpoints(
    ray_url: str, expected_logits: Callable[[np.ndarray], np.ndarray]
) -> None:
    with httpx.Client(base_url=ray_url, timeout=30) as c:
        assert c.get("/v2/health/ready").json() == {"ready": True}
        assert c.get("/v2/models/tiny").json()["inputs"][0]["shape"] == [-1, 4]
        body = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32",
                            "data": X.ravel().tolist()}]}  # fmt: skip

        def call(_: int) -> httpx.Response:
            return c.post("/v2/models/tiny/infer", json=body)

        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(call, range(24)))
        for r in responses:
            assert r.status_code == 200, r.text
            logits = np.reshape(r.json()["outputs"][0]["data"], (2, 3))
            np.testing.assert_allclose(logits, expected_logits(X), rtol=1e-6)
        bad = c.post("/v2/models/tiny/infer", json={"inputs": []})
        assert bad.status_code == 400 and "non-empty" in bad.json()["error"]
        assert "slimline_requests_total" in c.get("/metrics").text


def test_app_builder_rejects_unknown_keys(model_dir: Path) -> None:
    from slimline.errors import ServeError
    from slimline.serve.ray import app_builder

    with pytest.raises(ServeError, match="app_builder takes"):
        app_builder({"models": str(model_dir / "tiny.onnx"), "replica": "2"})


def test_replica_loads_its_models_and_leaves_no_temp_directory(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    from slimline.serve.ray import load_blobs, read_models

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    models = load_blobs(read_models([model_dir / "tiny.onnx"]), ServeSettings(threads=1))
    assert list(tmp_path.iterdir()) == []  # the ONNX bytes lived on disk only while loading
    out = models[0].backend.run({"x": X})
    assert out["logits"].shape == (2, 3)


def test_replica_health_check_raises_once_a_batcher_died(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from slimline.serve import DynamicBatcher, load_served_models
    from slimline.serve.app import ServerState
    from slimline.serve.batcher import BatcherStopped
    from slimline.serve.ray import replica_health

    def broken_select(self: DynamicBatcher, first: object) -> object:
        raise RuntimeError("bug in batch formation")

    async def main() -> None:
        state = ServerState(load_served_models([model_dir / "tiny.onnx"]), ServeSettings())
        await state.start()
        await state.warmed()
        replica_health(state)  # healthy: returns
        monkeypatch.setattr(DynamicBatcher, "_select", broken_select)
        with pytest.raises(BatcherStopped):
            await state.batchers["tiny"].submit({"x": X})
        with pytest.raises(RuntimeError, match="batcher of model 'tiny' stopped"):
            replica_health(state)
        await state.stop()

    asyncio.run(main())
