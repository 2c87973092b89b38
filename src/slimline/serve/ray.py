"""Scale-out on Ray Serve: the same app, batcher and v2 endpoints in N replicas.

Each replica is a Ray actor running :func:`slimline.serve.app.build_app` (KServe v2 routes,
the same :class:`~slimline.serve.batcher.DynamicBatcher`, metrics, auth) behind Ray's HTTP
proxy, which spreads requests over the replicas. Ray is the distributed engine; nothing here
does any clustering of its own.

Three ways in:

* ``slimline serve RUN_DIR --backend ray --replicas 4`` starts (or joins, with ``RAY_ADDRESS``)
  a Ray instance, deploys, and serves until SIGTERM;
* :func:`serve_on_ray` / :func:`build_ray_app` from Python;
* ``serve run slimline.serve.ray:app_builder models=runs/x replicas=4`` (or the same import path
  in a ``serve deploy`` config file) on a running cluster.

The driver reads each ONNX file and ships its bytes to the replicas through Ray, so worker
nodes need no shared filesystem (models with external-data files are not supported).
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

from ray import serve

from ..errors import ServeError
from .app import ServerState, ServeSettings, build_app
from .batcher import BatcherConfig
from .model import ServedModel, make_backend, resolve_model_path
from .server import READY_LINE

__all__ = [
    "ModelBlob",
    "V2Replica",
    "app_builder",
    "build_ray_app",
    "load_blobs",
    "replica_health",
    "serve_on_ray",
]

log = logging.getLogger(__name__)
ModelBlob = tuple[str, bytes, dict[str, Any]]  # served name, ONNX bytes, meta


@serve.ingress()
class V2Replica:
    """One Ray Serve replica: loads the models, builds the v2 app, warms up before traffic."""

    def __init__(self, blobs: list[ModelBlob], settings: ServeSettings) -> None:
        self.models = load_blobs(blobs, settings)
        self._asgi = build_app(self.models, settings, warm_first=True)

    def __serve_build_asgi_app__(self) -> Any:
        return self._asgi

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy (restarted)."""
        replica_health(self._asgi.state.slimline)


def replica_health(state: ServerState) -> None:
    """Raise if the replica cannot serve: its warm-up failed or a batcher died."""
    problem = state.problem
    if problem:
        raise RuntimeError(problem)


def load_blobs(blobs: list[ModelBlob], settings: ServeSettings) -> list[ServedModel]:
    """ONNX Runtime sessions for the shipped models; the temp files are gone when it returns.

    A session holds the whole graph in memory once created (external data is not supported
    here), so the files are only needed while the sessions are built.
    """
    models = []
    with tempfile.TemporaryDirectory(prefix="slimline-replica-") as tmp:
        for name, data, meta in blobs:
            path = Path(tmp) / f"{name}.onnx"
            path.write_bytes(data)
            runtime = meta.get("runtime") or "onnxruntime"  # the run's pick, as served locally
            backend = make_backend(
                path,
                settings.threads,
                runtime,
                spinning=settings.ort_spinning,
                instances=settings.batching.instances,
            )
            models.append(ServedModel(name, backend, source=meta.get("source", ""), meta=meta))
    return models


def read_models(paths: list[Path]) -> list[ModelBlob]:
    blobs: list[ModelBlob] = []
    for path in paths:
        name, onnx_path, meta = resolve_model_path(Path(path))
        if any(b[0] == name for b in blobs):
            raise ServeError(f"two models are both named {name!r}; rename one .onnx file")
        blobs.append((name, onnx_path.read_bytes(), meta))
    return blobs


def build_ray_app(
    paths: list[Path],
    settings: ServeSettings,
    *,
    replicas: int = 1,
    cpus_per_replica: float = 1.0,
) -> Any:
    """A Ray Serve application of ``replicas`` replicas serving ``paths``."""
    if replicas < 1:
        raise ServeError(f"--replicas is {replicas}; give at least 1")
    b = settings.batching
    deployment = serve.deployment(
        name="slimline",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus_per_replica},
        # let the replica's own queue policy (503 when full, 504 on deadline) govern
        max_ongoing_requests=b.max_queue_size + b.max_batch_size * b.instances,
        graceful_shutdown_timeout_s=settings.drain_timeout_s,
    )(V2Replica)
    return deployment.bind(read_models(paths), settings)


def app_builder(args: dict[str, str]) -> Any:
    """Entry point for ``serve run slimline.serve.ray:app_builder models=a.onnx,runs/x ...``.

    Keys: ``models`` (comma-separated), ``replicas``, ``threads``, ``max_batch_size``,
    ``max_queue_delay_ms``, ``max_queue_size``, ``timeout_ms``, ``instances``.
    """
    known = {"models", "replicas", "threads", *BatcherConfig.model_fields}
    unknown = set(args) - known
    if unknown or "models" not in args:
        raise ServeError(
            f"app_builder takes {', '.join(sorted(known))}; got {', '.join(sorted(args))}"
        )
    batching = BatcherConfig(**{k: v for k, v in args.items() if k in BatcherConfig.model_fields})
    settings = ServeSettings(batching=batching, threads=int(args.get("threads", 1)))
    paths = [Path(p) for p in args["models"].split(",") if p]
    return build_ray_app(paths, settings, replicas=int(args.get("replicas", 1)))


def serve_on_ray(
    paths: list[Path], settings: ServeSettings, *, replicas: int = 1, address: str | None = None
) -> None:
    """Deploy on Ray (local, or the cluster at ``address``/``RAY_ADDRESS``) until SIGTERM."""
    import ray

    app = build_ray_app(paths, settings, replicas=replicas)
    ray.init(address=address or os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(app, name="slimline", route_prefix="/")
        print(f"{READY_LINE}http://{settings.host}:{settings.port}", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
