"""The HTTP server: KServe v2 endpoints over the dynamic batcher, as a FastAPI app.

``build_app(models, settings)`` returns an ASGI app. Its lifespan starts the
:class:`~slimline.serve.state.ServerState`: one :class:`~slimline.serve.batcher.DynamicBatcher`
per model version, warmed up at the powers of two up to ``max_batch_size`` (the server is live at
once and ready after warm-up), the gRPC front end (``grpc_port``) and the model repository
(``repository``); at shutdown it drains every queue before it returns. A batcher whose collector
died makes the server neither live nor ready, so an orchestrator restarts it.

The part of a request both protocols share is :mod:`slimline.serve.requests`
(:mod:`slimline.serve.grpc_server` is the other protocol).
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from starlette.requests import ClientDisconnect
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .. import __version__
from .model import ServedModel
from .protocol import (
    HEADER_LENGTH,
    ProtocolError,
    decode_body,
    encode_response,
    model_metadata,
    parse_infer_request,
)
from .requests import classify_error, in_pool, infer_tensors
from .schema import (
    ErrorBody,
    InferenceRequest,
    InferenceResponse,
    LiveBody,
    ModelMetadata,
    ReadyBody,
    ServerMetadata,
)
from .state import ServerState, ServeSettings, Slot, example_inputs

__all__ = [
    "TIMEOUT_HEADER",
    "ServeSettings",
    "ServerState",
    "build_app",
    "example_inputs",
]

log = logging.getLogger(__name__)
TIMEOUT_HEADER = "X-Request-Timeout-Ms"
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
OFFLOAD_BYTES = 256 * 1024  # bodies/outputs above this are decoded/encoded off the event loop
_ACCEPTED_TYPES = frozenset({"", "application/json", "application/octet-stream"})


# -- the app ------------------------------------------------------------------------------
def build_app(
    models: list[ServedModel], settings: ServeSettings | None = None, *, warm_first: bool = False
) -> FastAPI:
    """A FastAPI app serving ``models``; run it with uvicorn (see :mod:`slimline.serve`).

    The server is live at once and ready after warm-up; ``warm_first`` makes start-up itself
    wait for warm-up (for hosts such as Ray Serve that route traffic once start-up returns).
    """
    settings = settings or ServeSettings()
    if not models and settings.repository is None:
        raise ValueError("build_app needs at least one model (or a model repository)")
    state = ServerState(models, settings)
    if settings.repository is not None:
        from .repository import Repository

        state.repository = Repository(state, settings.repository, settings.version_policy,
                                      gate=settings.gate)  # fmt: skip

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        if settings.grpc_port is not None:
            from .grpc_server import GrpcFrontEnd  # grpcio loads only when asked for

            state.grpc = GrpcFrontEnd(state)
            await state.grpc.start(settings.host, settings.grpc_port)
        if warm_first:
            await state.warmed()
        try:
            yield
        finally:
            await state.stop()

    app = _ServeApp(
        title="slimline inference server",
        version=__version__,
        description="Open Inference Protocol (KServe v2) with dynamic batching.",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.slimline = state
    _add_health_routes(app, state)
    _add_model_routes(app, state)
    _add_repository_routes(app, state)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    if settings.api_token is not None:
        app.add_middleware(BearerAuth, token=settings.api_token.get_secret_value())
    return app


def _json(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = orjson.dumps(doc)
    return Response(body, status, headers=headers, media_type="application/json")


def _error(message: str, status: int, headers: dict[str, str] | None = None) -> Response:
    return _json({"error": message}, status, headers)


def _add_health_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v2", response_model=ServerMetadata, tags=["server"])
    async def server_metadata() -> Response:
        extensions = ["binary_tensor_data", *state.extensions()]
        doc = {"name": "slimline", "version": __version__, "extensions": extensions}
        return _json(doc)

    @app.get(
        "/v2/health/live",
        response_model=LiveBody,
        responses={503: {"model": LiveBody}},
        tags=["health"],
    )
    async def live() -> Response:
        return _json({"live": state.healthy}, 200 if state.healthy else 503)

    @app.get(
        "/v2/health/ready",
        response_model=ReadyBody,
        responses={503: {"model": ReadyBody}},
        tags=["health"],
    )
    async def ready() -> Response:
        doc: dict[str, Any] = {"ready": state.ready}
        if state.degraded:
            doc.update(degraded=True, reason=state.degraded)
        if state.unavailable():  # repository versions that failed to load, with the reason
            doc["unavailable"] = state.unavailable()
        return _json(doc, 200 if state.ready else 503)

    @app.get("/metrics", tags=["server"], response_class=Response)
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4")


def _add_model_routes(app: _ServeApp, state: ServerState) -> None:
    async def metadata(name: str, version: str | None = None) -> Response:
        model, problem = _lookup(state, name, version)
        return problem or _json(model_metadata(model))  # type: ignore[arg-type]

    async def model_ready(name: str, version: str | None = None) -> Response:
        _, problem = _lookup(state, name, version)
        ok = problem is None and state.model_ready(name, version)
        return problem or _json({"ready": ok}, 200 if ok else 503)

    # one handler per route shape, so the OpenAPI document lists exactly the path parameters
    async def model_metadata_(name: str) -> Response:
        return await metadata(name)

    async def model_version_metadata(name: str, version: str) -> Response:
        return await metadata(name, version)

    async def model_ready_(name: str) -> Response:
        return await model_ready(name)

    async def model_version_ready(name: str, version: str) -> Response:
        return await model_ready(name, version)

    async def infer(request: Request, name: str) -> Response:
        return await _infer(state, _Call(request.scope, request.receive), name, None)

    async def infer_version(request: Request, name: str, version: str) -> Response:
        return await _infer(state, _Call(request.scope, request.receive), name, version)

    endpoint = app.infer_endpoint = InferEndpoint(state)
    errors: dict[int | str, dict[str, Any]] = {404: {"model": ErrorBody}}
    infer_errors: dict[int | str, dict[str, Any]] = {
        c: {"model": ErrorBody} for c in (400, 404, 413, 415, 503, 504)
    }
    ready_errors: dict[int | str, dict[str, Any]] = {**errors, 503: {"model": ReadyBody}}
    routes = (
        ("/v2/models/{name}", model_metadata_, model_ready_, infer),
        ("/v2/models/{name}/versions/{version}", model_version_metadata, model_version_ready,
         infer_version),
    )  # fmt: skip
    for prefix, meta_fn, ready_fn, infer_fn in routes:
        app.get(prefix, response_model=ModelMetadata, responses=errors, tags=["model"])(meta_fn)
        app.get(prefix + "/ready", response_model=ReadyBody, responses=ready_errors,
                tags=["model"])(ready_fn)  # fmt: skip
        app.post(
            prefix + "/infer",
            response_model=InferenceResponse,
            responses=infer_errors,
            openapi_extra={"requestBody": _INFER_BODY},
            tags=["model"],
        )(infer_fn)
        # The same handler as a raw ASGI route, matched before the documented FastAPI route
        # above, so requests skip FastAPI's per-request dependency solving and validation. Most
        # infer requests do not even come this way: _ServeApp hands them to it directly.
        app.router.routes.insert(0, Route(prefix + "/infer", endpoint, methods=["POST"]))


def _add_repository_routes(app: FastAPI, state: ServerState) -> None:
    """The v2 model repository extension: the index, load and unload."""

    async def index(request: Request) -> Response:
        ready_only = False
        if request.method == "POST":
            body = await request.body()
            try:
                ready_only = bool(orjson.loads(body).get("ready", False)) if body else False
            except (orjson.JSONDecodeError, AttributeError):
                return _error("the index request body must be a JSON object", 400)
        return _json(state.repository_index(ready_only))

    async def act(action: str, name: str) -> Response:
        try:
            await state.repository_action(action, name)
        except ProtocolError as err:
            return _error(str(err), err.status)
        return _json({})

    async def load(name: str) -> Response:
        return await act("load", name)

    async def unload(name: str) -> Response:
        return await act("unload", name)

    errors: dict[int | str, dict[str, Any]] = {c: {"model": ErrorBody} for c in (400, 404, 501)}
    app.get("/v2/repository/index", tags=["repository"], operation_id="repository_index_get")(index)
    app.post("/v2/repository/index", tags=["repository"], operation_id="repository_index")(index)
    app.post("/v2/repository/models/{name}/load", responses=errors, tags=["repository"])(load)
    app.post("/v2/repository/models/{name}/unload", responses=errors, tags=["repository"])(unload)


def _lookup(
    state: ServerState, name: str, version: str | None
) -> tuple[ServedModel | None, Response | None]:
    try:
        return state.find(name, version).model, None
    except ProtocolError as err:
        return None, _error(str(err), err.status)


# -- the infer hot path ------------------------------------------------------------------
class _ServeApp(FastAPI):
    """FastAPI, with POSTs to an infer path handed straight to :class:`InferEndpoint`.

    Every other request, and infer requests when a root path is set or FastAPI's own
    OpenTelemetry instrumentation is configured, takes FastAPI's usual way (middleware stack,
    router), where the same endpoint is the route. Skipping that way saves the event loop
    tens of microseconds per request (``bench/serve_cpu_per_request.py``).
    """

    infer_endpoint: InferEndpoint
    _telemetry_seen: tuple[float, bool] = (-1.0, False)  # (when checked, FastAPI telemetry on)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not self.root_path:
            target = infer_target(scope["path"])
            if target is not None and not scope.get("root_path") and not self._telemetry_on():
                await self.infer_endpoint.direct(scope, receive, send, *target)
                return
        await super().__call__(scope, receive, send)

    def _telemetry_on(self) -> bool:
        """Whether FastAPI's own OpenTelemetry instrumentation is configured, looked up at most
        once a second: the look-up reads environment variables, about 10 µs per request."""
        now = time.monotonic()
        checked, on = self._telemetry_seen
        if now - checked >= 1.0:
            telemetry = getattr(self, "_native_telemetry", None)  # FastAPI >= 0.160
            on = telemetry is not None and bool(telemetry.enabled())
            self._telemetry_seen = (now, on)
        return on


def infer_target(path: str) -> tuple[str, str | None] | None:
    """``(name, version)`` of a path the infer routes match (``/v2/models/{name}/infer``,
    ``/v2/models/{name}/versions/{version}/infer``), else None."""
    if not (path.startswith("/v2/models/") and path.endswith("/infer")):
        return None
    parts = path[len("/v2/models/") : -len("/infer")].split("/")
    if len(parts) == 1 and parts[0]:
        return parts[0], None
    if len(parts) == 3 and parts[1] == "versions" and parts[0] and parts[2]:
        return parts[0], parts[2]
    return None


class InferEndpoint:
    """The infer route as an ASGI app (the router calls it with ``path_params`` in the scope)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        token = state.settings.api_token
        self.token = None if token is None else token.get_secret_value().encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = scope["path_params"]
        await self.answer(scope, receive, send, params["name"], params.get("version"))

    async def direct(
        self, scope: Scope, receive: Receive, send: Send, name: str, version: str | None
    ) -> None:
        """Called before any middleware: checks the API token as :class:`BearerAuth` does."""
        if self.token is not None and not _token_matches(scope, self.token):
            await _send_401(send)
            return
        await self.answer(scope, receive, send, name, version)

    async def answer(
        self, scope: Scope, receive: Receive, send: Send, name: str, version: str | None
    ) -> None:
        response = await _infer(self.state, _Call(scope, receive), name, version)
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": response.raw_headers})  # fmt: skip
        await send({"type": "http.response.body", "body": response.body})


_CALL_HEADERS = {
    b"content-type": 0,
    b"content-length": 1,
    b"content-encoding": 2,
    HEADER_LENGTH.lower().encode(): 3,
    TIMEOUT_HEADER.lower().encode(): 4,
}


class _Call:
    """What the infer path reads of a request: five headers (the first of each, as Starlette's
    ``Headers.get`` gives them), read in one pass over the scope, and the body's messages."""

    __slots__ = ("content_encoding", "content_length", "content_type", "header_length",
                 "receive", "timeout")  # fmt: skip

    def __init__(self, scope: Scope, receive: Receive) -> None:
        found: list[str | None] = [None] * len(_CALL_HEADERS)
        for key, value in scope["headers"]:
            i = _CALL_HEADERS.get(key)
            if i is not None and found[i] is None:
                found[i] = value.decode("latin-1")
        self.content_type, self.content_length, self.content_encoding = found[:3]
        self.header_length, self.timeout = found[3:]
        self.receive = receive


# -- inference ----------------------------------------------------------------------------
async def _infer(state: ServerState, call: _Call, name: str, version: str | None) -> Response:
    try:
        slot = state.find(name, version)
    except ProtocolError as err:
        return _error(str(err), err.status)
    started = time.perf_counter()
    series = state.observers[name]
    series.inflight.inc()
    slot.inflight += 1  # the version stays in service until this request is answered
    outcome = "error"
    try:
        response, outcome = await _answer(state, slot, call)
        if outcome == "ok":
            series.latency.observe(time.perf_counter() - started)
        return response
    finally:
        slot.inflight -= 1
        series.inflight.dec()
        series.requests[outcome].inc()


async def _answer(state: ServerState, slot: Slot, call: _Call) -> tuple[Response, str]:
    """The response and its outcome label; every failure mode maps to one status here."""
    try:
        return await _run_request(state, slot, call), "ok"
    except Exception as err:
        status, outcome, message = classify_error(err, slot.model)
        headers = {"Retry-After": "1"} if outcome == "rejected" else None
        return _error(message, status, headers), outcome


async def _run_request(state: ServerState, slot: Slot, call: _Call) -> Response:
    settings = state.settings
    model = slot.model
    slot.batcher.check_admission()  # under overload, refuse before reading and decoding the body
    timeout_s = _header_timeout(call.timeout)
    body = await _read_body(call, settings.max_body_bytes)
    header_length = call.header_length
    if len(body) > OFFLOAD_BYTES:  # keep the event loop (and the deadline timers) responsive
        req = await in_pool(state, lambda b: parse_infer_request(b, header_length), body)
    else:
        req = parse_infer_request(body, header_length)
    outputs, parameters = await infer_tensors(state, slot, req, timeout_s)
    if sum(v.nbytes for v in outputs.values()) > OFFLOAD_BYTES:
        body_out, headers = await in_pool(
            state, lambda o: encode_response(model, req, o, parameters), outputs
        )
    else:
        body_out, headers = encode_response(model, req, outputs, parameters)
    return Response(body_out, 200, headers=headers)


def _header_timeout(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not 0.0 < ms <= 3_600_000.0:
        raise ProtocolError(f"{TIMEOUT_HEADER} is {value!r}; give milliseconds in (0, 3600000]")
    return ms / 1000.0


async def _read_body(call: _Call, limit: int) -> bytes:
    ctype = (call.content_type or "").split(";")[0].strip().lower()
    if ctype not in _ACCEPTED_TYPES:
        raise ProtocolError(
            f"content type {ctype!r} is not accepted; send application/json (or "
            f"application/octet-stream with {HEADER_LENGTH})",
            415,
        )
    declared = call.content_length
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProtocolError(f"the body is {declared} bytes, above the {limit}-byte limit", 413)
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await call.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        if message["type"] != "http.request":
            continue
        more = message.get("more_body", False)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ProtocolError(f"the body exceeds the {limit}-byte limit; send less", 413)
        chunks.append(chunk)
    return decode_body(b"".join(chunks), call.content_encoding, limit)


# -- auth ---------------------------------------------------------------------------------
class BearerAuth:
    """ASGI middleware: every path but the health probes needs ``Authorization: Bearer``.

    The token is compared with :func:`hmac.compare_digest`, in constant time.
    """

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any
    ) -> None:
        open_path = scope["type"] != "http" or scope["path"] in OPEN_PATHS
        if not open_path and not _token_matches(scope, self.token):
            await _send_401(send)
            return
        await self.app(scope, receive, send)


def _token_matches(scope: Scope, token: bytes) -> bool:
    given = b""
    for key, value in scope["headers"]:
        if key == b"authorization" and value[:7].lower() == b"bearer ":
            given = value[7:].strip()
    return hmac.compare_digest(given, token)


async def _send_401(send: Any) -> None:
    body = b'{"error":"missing or wrong API token; send Authorization: Bearer <token>"}'
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# -- OpenAPI ------------------------------------------------------------------------------
_INFER_BODY = {
    "required": True,
    "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/InferenceRequest"}},
        "application/octet-stream": {
            "schema": {"type": "string", "format": "binary"},
            "description": f"JSON header of {HEADER_LENGTH} bytes, then raw tensor bytes",
        },
    },
}


_TIMEOUT_PARAM = {
    "name": TIMEOUT_HEADER,
    "in": "header",
    "required": False,
    "schema": {"type": "number", "exclusiveMinimum": 0},
    "description": "deadline of this request in milliseconds (default: the server's)",
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=app.description,
                          routes=app.routes)  # fmt: skip
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        req = InferenceRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(req.pop("$defs", {}))
        schemas["InferenceRequest"] = req
        for path in doc["paths"].values():
            if "post" in path:
                path["post"].setdefault("parameters", []).append(_TIMEOUT_PARAM)
        app.openapi_schema = doc
    return app.openapi_schema


def default_threads(instances: int) -> int:
    """Intra-op threads per batch so that ``instances`` batches share the cores."""
    return max(1, (os.cpu_count() or 1) // instances)
