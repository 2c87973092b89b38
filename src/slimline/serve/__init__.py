"""Serving: KServe v2 over HTTP and gRPC with dynamic batching, a versioned model repository,
metrics, model monitoring, and Ray Serve scale-out.

From the command line::

    slimline serve runs/<id> model.onnx --max-batch-size 16 --max-queue-delay-ms 2

From Python (load tests, notebooks, other slimline commands)::

    from slimline.serve import ServeSettings, load_served_models, run_in_thread

    models = load_served_models([Path("runs/<id>")], threads=2)
    with run_in_thread(models, ServeSettings(port=0)) as url:   # ready (warm) when it yields
        ...  # POST f"{url}/v2/models/{models[0].name}/infer"

    # in a child process (own CPU, SIGTERM on exit), same flags as the CLI:
    with run_in_subprocess(["runs/<id>"], ["--max-batch-size", "16"]) as (url, proc):
        ...

    app = build_app(models, settings)   # a plain ASGI app, for any ASGI server or test client

    # HTTP and gRPC from one process, one batcher per model version:
    with serve_in_thread(models, ServeSettings(port=0, grpc_port=0)) as handle:
        ...  # handle.url, handle.grpc_target

Scale-out: :func:`slimline.serve.ray.serve_on_ray` (``slimline serve --backend ray --replicas N``)
deploys the same app, batcher and endpoints as a Ray Serve application. ``DynamicBatcher`` is
usable on its own (no HTTP in it). See docs/serving.md.
"""

from __future__ import annotations

from .app import TIMEOUT_HEADER, ServeSettings, build_app
from .batcher import BatcherConfig, DynamicBatcher
from .model import (
    FakeBackend,
    InferenceBackend,
    OrtBackend,
    ServedModel,
    TensorSpec,
    load_served_models,
)
from .server import (
    ServerHandle,
    run_in_subprocess,
    run_in_thread,
    serve_forever,
    serve_in_thread,
)

__all__ = [
    "TIMEOUT_HEADER",
    "BatcherConfig",
    "DynamicBatcher",
    "FakeBackend",
    "InferenceBackend",
    "OrtBackend",
    "ServeSettings",
    "ServedModel",
    "ServerHandle",
    "TensorSpec",
    "build_app",
    "load_served_models",
    "run_in_subprocess",
    "run_in_thread",
    "serve_forever",
    "serve_in_thread",
]
