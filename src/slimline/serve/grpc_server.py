"""The Open Inference Protocol over gRPC, beside HTTP, in the same process and event loop.

:class:`GrpcFrontEnd` runs a ``grpc.aio`` server on the app's event loop. Its ``ModelInfer``
decodes a request into the same :class:`~slimline.serve.protocol.InferRequest` that HTTP builds
and runs it through :func:`~slimline.serve.requests.infer_tensors`, so both protocols share each
model's batcher, queue policy, deadlines, API token, metrics and model monitors. Failures map
through :func:`~slimline.serve.requests.classify_error`, then from the HTTP status to a gRPC code:
400/413/415 ``INVALID_ARGUMENT``, 404 ``NOT_FOUND``, 503 ``UNAVAILABLE``, 504
``DEADLINE_EXCEEDED``, 500 ``INTERNAL``.

``ModelStreamInfer`` (Triton's bidirectional stream, which ``tritonclient.grpc``'s
``start_stream`` / ``async_stream_infer`` use) runs every request of a stream through the same
path, concurrently, answering each as it finishes. A stream costs gRPC's Python layer a read
and a write per request instead of a whole call (its set-up, metadata and status), which is
most of what a unary call costs beyond HTTP (``bench/RESULTS-serve.md``).

Tensors travel as ``raw_input_contents`` (one entry per input, little-endian) or as typed
``contents``; outputs always go back as ``raw_output_contents``, as Triton does. A client's gRPC
deadline is the request's deadline (the ``timeout`` parameter in microseconds too; the smaller
wins). Messages above the body limit (``--max-body-mb``) get ``INVALID_ARGUMENT`` naming the
input that crossed it; above twice the limit gRPC itself refuses them (``RESOURCE_EXHAUSTED``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import numpy as np

from .. import __version__
from ..errors import ServeError
from .proto import grpc_predict_v2_pb2 as pb
from .proto import grpc_predict_v2_pb2_grpc as pb_grpc
from .protocol import (
    NP_TO_V2,
    V2_TO_NP,
    InferRequest,
    ProtocolError,
    RequestedOutput,
    model_metadata,
)
from .requests import classify_error, infer_tensors

if TYPE_CHECKING:
    from .model import ServedModel
    from .state import ServerState, Slot

__all__ = ["GrpcFrontEnd", "grpc_code", "request_tensors", "response_message"]

log = logging.getLogger(__name__)
Tensors = dict[str, np.ndarray]
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# the typed `contents` field that carries each datatype (FP16 travels raw only)
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
_OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC status code of an HTTP status (the protocol's HTTP/gRPC correspondence)."""
    return _CODES.get(status, grpc.StatusCode.INTERNAL)


# -- decoding and encoding -----------------------------------------------------------------
def request_tensors(request: pb.ModelInferRequest, limit: int) -> InferRequest:
    """The request's tensors and options; a ProtocolError naming the input at fault."""
    if not request.inputs:
        raise ProtocolError("the request has no inputs; send at least one tensor")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; send "
            "one entry per input, in order"
        )
    inputs: Tensors = {}
    total = 0
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        if not name:
            raise ProtocolError(f"inputs[{i}] has no name; name every input tensor")
        if name in inputs:
            raise ProtocolError(f"input {name!r} appears twice; send each input once")
        arr = _tensor(tensor, raw[i] if raw else None)
        total += arr.nbytes
        if total > limit:
            raise ProtocolError(
                f"input {name!r} brings the request to {total} bytes, above the {limit}-byte "
                "limit; send fewer rows per request",
                413,
            )
        inputs[name] = arr
    outputs = [RequestedOutput(o.name, None) for o in request.outputs] or None
    return InferRequest(
        id=request.id or None,
        inputs=inputs,
        outputs=outputs,
        binary_output=True,
        timeout_s=_timeout_param(request.parameters),
    )


def _tensor(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> np.ndarray:
    name, datatype = tensor.name, tensor.datatype
    if datatype not in V2_TO_NP:
        kind = "BYTES, which this server does not serve" if datatype == "BYTES" else "unknown"
        raise ProtocolError(
            f"input {name!r}: datatype {datatype!r} is {kind}; use one of {', '.join(V2_TO_NP)}"
        )
    shape = list(tensor.shape)
    if any(d < 0 for d in shape):
        raise ProtocolError(f"input {name!r}: shape {shape} has a negative dimension")
    dtype = np.dtype(V2_TO_NP[datatype])
    count = math.prod(shape)
    if raw is not None:
        if tensor.HasField("contents"):
            raise ProtocolError(
                f"input {name!r} has both contents and raw_input_contents; send one of them"
            )
        need = count * dtype.itemsize
        if len(raw) != need:
            raise ProtocolError(
                f"input {name!r}: raw_input_contents holds {len(raw)} bytes but shape {shape} of "
                f"{datatype} needs {need}; fix the shape or the data"
            )
        wire = dtype.newbyteorder("<")
        return np.frombuffer(raw, dtype=wire).astype(dtype, copy=False).reshape(shape)
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise ProtocolError(f"input {name!r} is {datatype}; send it in raw_input_contents")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise ProtocolError(
            f"input {name!r}: shape {shape} needs {count} values, {field} has {len(values)}; "
            "make shape and data agree"
        )
    arr = np.asarray(values, dtype=np.float64 if dtype.kind == "f" else None)
    if dtype.kind in "iu" and arr.size:
        info = np.iinfo(dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise ProtocolError(
                f"input {name!r}: values out of range for {datatype} [{info.min}, {info.max}]"
            )
    return arr.astype(dtype).reshape(shape)


def _timeout_param(params: Any) -> float | None:
    if "timeout" not in params:
        return None
    value = params["timeout"].int64_param
    if not 0 < value <= 3_600_000_000:
        raise ProtocolError(
            f"parameter timeout is {value}; give a whole number of microseconds in 1..3600000000"
        )
    return float(value) / 1e6


def response_message(
    model: ServedModel,
    req: InferRequest,
    outputs: Tensors,
    parameters: dict[str, Any] | None,
    response: pb.ModelInferResponse | None = None,
) -> pb.ModelInferResponse:
    """The outputs asked for (all, by default), as raw little-endian bytes; written into
    ``response`` when given (a stream answer's ``infer_response``, so it is not copied)."""
    if response is None:
        response = pb.ModelInferResponse()
    response.model_name, response.model_version = model.name, model.version
    response.id = req.id or ""
    names = [o.name for o in req.outputs] if req.outputs else list(outputs)
    for name in names:
        arr = np.asarray(outputs[name])
        entry = response.outputs.add(name=name, shape=arr.shape)
        entry.datatype = NP_TO_V2.get(arr.dtype.name, "BYTES")
        response.raw_output_contents.append(
            np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
        )
    for key, value in (parameters or {}).items():
        _set_parameter(response.parameters[key], value)
    return response


def _set_parameter(param: pb.InferParameter, value: Any) -> None:
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)


# -- the service ---------------------------------------------------------------------------
class _Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state
        token = state.settings.api_token
        self.token = None if token is None else token.get_secret_value().encode()

    async def _check_token(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if self.token is None:
            return
        given = b""
        for key, value in context.invocation_metadata() or ():
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            if key == "authorization" and text[:7].lower() == "bearer ":
                given = text[7:].strip().encode()
        if not hmac.compare_digest(given, self.token):
            await _abort(context, 401, "missing or wrong API token; send metadata "
                         "authorization: Bearer <token>")  # fmt: skip

    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.state.healthy)

    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        await self._check_token(context)
        extensions = ["binary_tensor_data", *self.state.extensions()]
        return pb.ServerMetadataResponse(
            name="slimline", version=__version__, extensions=extensions
        )

    async def ModelReady(self, request: Any, context: Any) -> pb.ModelReadyResponse:
        await self._check_token(context)  # an unknown (or unloaded) model is not ready, as in HTTP
        return pb.ModelReadyResponse(
            ready=self.state.model_ready(request.name, request.version or None)
        )

    async def ModelMetadata(self, request: Any, context: Any) -> pb.ModelMetadataResponse:
        await self._check_token(context)
        doc = model_metadata((await self._slot(request.name, request.version, context)).model)
        response = pb.ModelMetadataResponse(
            name=doc["name"], versions=doc["versions"], platform=doc["platform"]
        )
        for key in ("inputs", "outputs"):
            for t in doc[key]:
                getattr(response, key).add(name=t["name"], datatype=t["datatype"],
                                           shape=t["shape"])  # fmt: skip
        return response

    async def ModelInfer(self, request: Any, context: Any) -> pb.ModelInferResponse:
        if self.token is not None:  # the common case, no token, awaits nothing here
            await self._check_token(context)
        answer = await self._answer(request, context.time_remaining())
        if isinstance(answer, pb.ModelInferResponse):
            return answer
        await _abort(context, *answer)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Triton's streaming infer: every request on the stream runs at once through the same
        batcher (so they batch together) and is answered as soon as it is done, in any order,
        with its id; a failed request gets ``error_message`` ("CODE: message", the code that
        ``ModelInfer`` would have ended with) and the stream goes on."""
        if self.token is not None:
            await self._check_token(context)
        answers: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        reader = asyncio.ensure_future(self._read_stream(requests, context, answers))
        try:
            while (answer := await answers.get()) is not None:
                yield answer
        finally:
            reader.cancel()

    async def _read_stream(
        self,
        requests: AsyncIterator[pb.ModelInferRequest],
        context: Any,
        answers: asyncio.Queue[pb.ModelStreamInferResponse | None],
    ) -> None:
        running: set[asyncio.Task[None]] = set()

        async def one(request: pb.ModelInferRequest) -> None:
            reply = pb.ModelStreamInferResponse()
            answer = await self._answer(request, context.time_remaining(), reply.infer_response)
            if isinstance(answer, tuple):
                reply.error_message = f"{grpc_code(answer[0]).name}: {answer[1]}"
                reply.infer_response.model_name = request.model_name
                reply.infer_response.id = request.id
            answers.put_nowait(reply)

        try:
            async for request in requests:
                task = asyncio.create_task(one(request))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.gather(*running)
        finally:
            for left in running:
                left.cancel()
            answers.put_nowait(None)

    async def _answer(
        self,
        request: pb.ModelInferRequest,
        remaining: float | None,
        into: pb.ModelInferResponse | None = None,
    ) -> pb.ModelInferResponse | tuple[int, str]:
        """The response to one infer request, or (HTTP status, message) of its failure; counted
        in the model's metrics either way."""
        try:
            slot = self.state.find(request.model_name, request.model_version or None)
        except ProtocolError as err:
            return err.status, str(err)
        series = self.state.observers[slot.model.name]
        started = time.perf_counter()
        series.inflight.inc()
        slot.inflight += 1  # the version stays in service until this call is answered
        outcome = "error"
        try:
            response = await self._infer(slot, request, remaining, into)
            outcome = "ok"
            series.latency.observe(time.perf_counter() - started)
            return response
        except Exception as err:
            status, outcome, message = classify_error(err, slot.model)
            return status, message
        finally:
            slot.inflight -= 1
            series.inflight.dec()
            series.requests[outcome].inc()

    async def _infer(
        self, slot: Slot, request: Any, remaining: float | None, into: Any = None
    ) -> pb.ModelInferResponse:
        slot.batcher.check_admission()
        req = request_tensors(request, self.state.settings.max_body_bytes)
        timeout_s = min(t for t in (remaining, req.timeout_s, math.inf) if t is not None)
        outputs, parameters = await infer_tensors(
            self.state, slot, req, None if math.isinf(timeout_s) else max(timeout_s, 1e-3)
        )
        return response_message(slot.model, req, outputs, parameters, into)

    async def _slot(self, name: str, version: str, context: Any) -> Slot:
        try:
            return self.state.find(name, version or None)
        except ProtocolError as err:
            await _abort(context, err.status, str(err))

    async def RepositoryIndex(self, request: Any, context: Any) -> pb.RepositoryIndexResponse:
        await self._check_token(context)
        response = pb.RepositoryIndexResponse()
        for entry in self.state.repository_index(ready_only=request.ready):
            response.models.add(**entry)
        return response

    async def RepositoryModelLoad(
        self, request: Any, context: Any
    ) -> pb.RepositoryModelLoadResponse:
        await self._check_token(context)
        await self._repository_call("load", request.model_name, context)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: Any, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        await self._check_token(context)
        await self._repository_call("unload", request.model_name, context)
        return pb.RepositoryModelUnloadResponse()

    async def _repository_call(self, action: str, name: str, context: Any) -> None:
        try:
            await self.state.repository_action(action, name)
        except ProtocolError as err:
            await _abort(context, err.status, str(err))


async def _abort(context: Any, status: int, message: str) -> NoReturn:
    await context.abort(grpc_code(status), message)
    raise AssertionError("grpc's abort returned")  # it raises; this keeps the types honest


class GrpcFrontEnd:
    """A ``grpc.aio`` server on the running event loop, answering from one :class:`ServerState`."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.port: int | None = None
        limit = state.settings.max_body_bytes
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", min(2 * limit, 2**31 - 1)),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
            ]
        )
        add_servicer = pb_grpc.add_GRPCInferenceServiceServicer_to_server
        add_servicer(_Servicer(state), self.server)  # type: ignore[no-untyped-call]

    async def start(self, host: str, port: int) -> None:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as err:
            raise ServeError(
                f"cannot serve gRPC on {address} ({err}); choose another --grpc-port"
            ) from None
        await self.server.start()
        log.info("gRPC listening on %s:%d", host, self.port)

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls; calls already running finish (within ``grace_s``)."""
        await self.server.stop(grace_s)
