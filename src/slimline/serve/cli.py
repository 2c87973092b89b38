"""``slimline serve RUN_DIR_OR_ONNX [MORE ...]``: the command-line face of the server."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationError

from ..errors import ServeError, SlimlineError
from .app import ServeSettings, default_threads
from .batcher import BatcherConfig

__all__ = ["main", "register", "settings_from_args"]

TOKEN_ENV = "SLIMLINE_API_TOKEN"
log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    from .publish import register_publish

    register_publish(subparsers)
    parser = subparsers.add_parser(
        "serve",
        help="serve models over KServe v2 HTTP with dynamic batching",
        description="Serve a run's selected candidate (under the task's name) or .onnx files "
        "(under their file stems) on the Open Inference Protocol (KServe v2).",
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BatcherConfig()
    p.add_argument(
        "models", nargs="*", metavar="RUN_DIR_OR_ONNX", help="run directories or .onnx files"
    )
    p.add_argument("--repository", type=Path, default=None, metavar="DIR",
                   help="serve a model repository: DIR/<model>/<version>/ (a run directory's "
                   "files or one .onnx file per version); load/unload at /v2/repository")  # fmt: skip
    p.add_argument("--version-policy", default="latest:1",
                   help="repository versions served: latest:N (default latest:1), all, or "
                   "specific:1,3")  # fmt: skip
    p.add_argument("--gate", action="store_true",
                   help="a new repository version takes traffic only if `slimline check` of its "
                   "manifest against the serving version's passes")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="also serve the Open Inference Protocol over gRPC on this port (Triton's "
                   "default is 8001; 0: any free port)")  # fmt: skip
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="rows per batch")
    p.add_argument("--max-queue-delay-ms", type=float, default=d.max_queue_delay_ms,
                   help="longest wait for a batch to fill")  # fmt: skip
    p.add_argument("--fixed-delay", action="store_true",
                   help="always wait --max-queue-delay-ms for a batch to fill (default: only while "
                   "requests arrive at least once per window, so a lone request runs at once)")  # fmt: skip
    p.add_argument("--max-queue-size", type=int, default=d.max_queue_size,
                   help="queued requests per model; more are rejected with 503")  # fmt: skip
    p.add_argument("--timeout-ms", type=float, default=d.timeout_ms,
                   help="default request deadline (per request: X-Request-Timeout-Ms header)")  # fmt: skip
    p.add_argument("--instances", type=int, default=d.instances, help="batches run at once")
    p.add_argument("--threads", type=int, default=None,
                   help="ONNX Runtime threads per batch (default: cores / instances)")  # fmt: skip
    p.add_argument("--ort-spinning", action="store_true",
                   help="let idle ONNX Runtime threads spin (lower latency on dedicated cores)")  # fmt: skip
    p.add_argument("--api-token-file", type=Path, default=None,
                   help=f"require Authorization: Bearer <token in this file> (or set ${TOKEN_ENV})")  # fmt: skip
    p.add_argument("--max-body-mb", type=float, default=64.0, help="request body limit in MiB")
    p.add_argument("--allow-nonfinite", action="store_true", help="accept NaN/Inf inputs")
    p.add_argument("--drift-window", type=int, default=1000,
                   help="live prediction rows the drift score compares with the reference")  # fmt: skip
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="longest graceful drain after SIGTERM")  # fmt: skip
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local: this process; ray: a Ray Serve application")  # fmt: skip
    p.add_argument("--replicas", type=int, default=1, help="Ray Serve replicas (--backend ray)")
    p.add_argument("--runtime", choices=["onnxruntime", "openvino"], default=None,
                   help="serve on this runtime (default: the one the run picked; ONNX Runtime "
                   "for a .onnx file)")  # fmt: skip
    p.add_argument("--cascade", nargs=2, metavar=("EDGE", "CLOUD"), default=None,
                   help="serve EDGE; rows it is unsure of go to CLOUD (a run directory, an .onnx "
                   "file or a KServe v2 URL); see docs/edge.md")  # fmt: skip
    p.add_argument("--cascade-threshold", default=None,
                   help="escalate rows scored below this number, or the JSON that `slimline "
                   "cascade calibrate` wrote (its threshold and score)")  # fmt: skip
    p.add_argument("--cascade-score", default=None,
                   help="softmax (default), probability, margin, or FILE.py:FUNCTION")  # fmt: skip
    p.add_argument("--cascade-output", default=None, help="the output scored (default: first)")
    p.add_argument("--cloud-timeout-ms", type=float, default=1000.0,
                   help="longest wait for the cloud tier; then the edge answer is returned")  # fmt: skip
    p.add_argument("--memory-mb", type=float, default=None,
                   help="peak RSS budget per model: run the fastest measured ONNX Runtime setting "
                   "that fits (default: the run's recorded memory profile, if any)")  # fmt: skip


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    token = _token(args.api_token_file)
    try:
        batching = BatcherConfig(
            max_batch_size=args.max_batch_size,
            max_queue_delay_ms=args.max_queue_delay_ms,
            max_queue_size=args.max_queue_size,
            timeout_ms=args.timeout_ms,
            instances=args.instances,
            adaptive_delay=not args.fixed_delay,
        )
        return ServeSettings(
            host=args.host,
            port=args.port,
            grpc_port=args.grpc_port,
            repository=args.repository,
            version_policy=args.version_policy,
            gate=args.gate,
            drift_window=args.drift_window,
            batching=batching,
            threads=args.threads or default_threads(args.instances),
            ort_spinning=args.ort_spinning,
            api_token=SecretStr(token) if token else None,
            max_body_bytes=int(args.max_body_mb * (1 << 20)),
            allow_nonfinite=args.allow_nonfinite,
            drain_timeout_s=args.drain_timeout_s,
        )
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ServeError(f"serve option {where}: {first['msg']}; fix the flag") from None


def _token(path: Path | None) -> str | None:
    if path is not None:
        if not path.is_file():
            raise ServeError(f"API token file {path} does not exist; create it or drop the flag")
        token = path.read_text().strip()
        if not token:
            raise ServeError(f"API token file {path} is empty; put the token in it")
        return token
    return os.environ.get(TOKEN_ENV) or None


def _cascade(args: argparse.Namespace, settings: ServeSettings, memory: Any) -> Any:
    from .cascade import CascadeConfig, attach_cascade, load_threshold
    from .model import load_served_models

    if args.cascade_threshold is None:
        raise ServeError(
            "--cascade needs --cascade-threshold (a number, or the JSON `slimline cascade "
            "calibrate` writes)"
        )
    fields = load_threshold(args.cascade_threshold)
    if args.cascade_score:
        fields["score"] = args.cascade_score
    try:
        config = CascadeConfig(
            **fields, output=args.cascade_output, cloud_timeout_ms=args.cloud_timeout_ms
        )
    except ValidationError as err:
        first = err.errors()[0]
        raise ServeError(
            f"cascade option {first['loc'][0]}: {first['msg']}; fix the flag"
        ) from None

    def load(path: Path) -> Any:
        return load_served_models(
            [path],
            settings.threads,
            spinning=settings.ort_spinning,
            memory=memory,
            instances=settings.batching.instances,
        )[0]

    edge_path, cloud = args.cascade
    edge = load(Path(edge_path))
    return attach_cascade(edge, cloud, config, batching=settings.batching, load=load)


def _check_backend(args: argparse.Namespace) -> None:
    if not args.models and not args.cascade and args.repository is None:
        raise ServeError(
            "nothing to serve; pass RUN_DIR_OR_ONNX, --repository DIR or --cascade EDGE CLOUD"
        )
    if args.repository is not None and args.backend == "ray":
        raise ServeError("--repository runs with --backend local; drop --backend ray")
    if args.repository is not None:
        from .repository import parse_policy

        parse_policy(args.version_policy)
    if args.cascade and args.backend == "ray":
        raise ServeError("--cascade runs with --backend local; drop --backend ray")
    if args.backend == "local" and args.replicas != 1:
        raise ServeError("--replicas needs --backend ray; add it or drop --replicas")
    if args.backend == "ray" and args.grpc_port is not None:
        raise ServeError("--grpc-port runs with --backend local; drop --backend ray")
    if args.backend == "ray" and args.port == 0:
        raise ServeError("--backend ray needs a fixed --port (Ray's proxy cannot pick one)")


def run(args: argparse.Namespace) -> int:
    _check_backend(args)
    settings = settings_from_args(args)
    if settings.api_token is None and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "serving on %s without an API token: anyone who can reach it may call it; "
            "pass --api-token-file or set %s",
            settings.host,
            TOKEN_ENV,
        )
    if args.backend == "ray":
        from .ray import serve_on_ray

        serve_on_ray([Path(m) for m in args.models], settings, replicas=args.replicas)
        return 0
    from .model import load_served_models
    from .server import serve_forever

    paths = [Path(m) for m in args.models]
    memory = _memory(args, settings)
    models = load_served_models(
        paths,
        settings.threads,
        spinning=settings.ort_spinning,
        runtime=args.runtime,
        memory=memory,
        instances=settings.batching.instances,
    )
    if args.cascade:
        models.append(_cascade(args, settings, memory))
    serve_forever(models, settings)
    return 0


def _memory(args: argparse.Namespace, settings: ServeSettings) -> Any:
    from ..edge.serving import serving_memory

    budget = getattr(args, "memory_mb", None)
    if budget is not None and budget <= 0:
        raise ServeError(f"--memory-mb is {budget:g}; give a positive number of MB")
    return serving_memory(budget, settings.threads, settings.batching.max_batch_size)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m slimline.serve``: the serve command alone."""
    parser = argparse.ArgumentParser(prog="slimline serve")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except SlimlineError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
