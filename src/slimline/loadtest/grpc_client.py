"""The load generator's gRPC client: the Open Inference Protocol's ``ModelInfer`` over HTTP/2.

Requests are serialized ``ModelInferRequest`` messages built once per payload, with tensors in
``raw_input_contents`` (what ``tritonclient.grpc`` sends); the channel passes those bytes
through unserialized and leaves the answer unparsed, so a request costs the generator only the
gRPC call itself. Status codes map to the same outcomes as HTTP statuses: ``UNAVAILABLE`` is a
rejection (a full queue), ``DEADLINE_EXCEEDED`` a timeout, ``INVALID_ARGUMENT`` / ``NOT_FOUND``
/ ``UNAUTHENTICATED`` a bad request; a channel that cannot connect is a connection error.

With ``stream=True`` requests go on one ``ModelStreamInfer`` stream (Triton's bidirectional
streaming infer) instead of one call each: each request gets a unique ``id`` (appended to its
serialized bytes, which protobuf reads as the last value of the field), and a reader matches
answers to requests by it. A failed request's answer carries ``error_message`` ("CODE:
message"), mapped to an outcome as the call's status code would be.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import grpc
import numpy as np

from ..errors import LoadTestError
from ..serve.proto import grpc_predict_v2_pb2 as pb
from ..task import Inputs
from .payload import Payload, v2_datatype

__all__ = ["GrpcClient", "check_grpc_request", "grpc_payloads", "outcome_of_code"]

METHOD = "/inference.GRPCInferenceService/ModelInfer"
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
# no transparent retries (a retried request would be measured as one) and no BDP pings (the
# flow-control window of a loopback load test needs no probing); both cost the client CPU per
# call that it shares with the server (bench/RESULTS-serve.md)
_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_retries", 0),
    ("grpc.http2.bdp_probe", 0),
]
_BAD_REQUEST = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                          grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                          grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNIMPLEMENTED})  # fmt: skip


def outcome_of_code(code: grpc.StatusCode, details: str = "") -> str:
    if code == grpc.StatusCode.OK:
        return "ok"
    if code == grpc.StatusCode.UNAVAILABLE:
        # the channel's own failures also say UNAVAILABLE; the server's rejection names the queue
        lost = ("failed to connect", "connection refused", "socket closed", "connection reset")
        return "connection" if any(s in details.lower() for s in lost) else "rejected"
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return "timeout"
    if code in _BAD_REQUEST:
        return "bad_request"
    return "server_error"


def grpc_payloads(
    samples: Inputs, model: str, batch_size: int = 1, limit: int = 64
) -> list[Payload]:
    """Up to ``limit`` serialized requests of ``batch_size`` consecutive rows each."""
    n = len(next(iter(samples.values())))
    if batch_size < 1 or batch_size > n:
        raise LoadTestError(f"--batch-size {batch_size} must be between 1 and the {n} sample rows")
    starts = list(range(0, n - batch_size + 1, batch_size))[:limit]
    return [
        encode_grpc_request({k: v[s : s + batch_size] for k, v in samples.items()}, model)
        for s in starts
    ]


def encode_grpc_request(inputs: Inputs, model: str) -> Payload:
    request = pb.ModelInferRequest(model_name=model)
    for name, arr in inputs.items():
        datatype = v2_datatype(arr)
        if datatype == "BYTES":
            raise LoadTestError(f"input {name!r} is text; the gRPC load test sends numbers only")
        request.inputs.add(name=name, datatype=datatype, shape=arr.shape)
        raw = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
        request.raw_input_contents.append(raw)
    rows = len(next(iter(inputs.values())))
    return Payload(request.SerializeToString(), {}, rows)


def _metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


class GrpcClient:
    """``ModelInfer`` calls on one HTTP/2 channel (gRPC multiplexes calls on it), or with
    ``stream=True`` requests on one ``ModelStreamInfer`` stream."""

    def __init__(
        self,
        target: str,
        timeout_s: float = 30.0,
        token: str | None = None,
        *,
        stream: bool = False,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.metadata = _metadata(token)
        self.stream = stream
        self.channel: grpc.aio.Channel | None = None
        self.call: Any = None
        self.error_samples: dict[str, str] = {}
        self._stream: _Stream | None = None

    async def connect(self, n: int) -> None:
        """Open the channel ahead of the run (``n`` is the HTTP client's connection count)."""
        self.channel = grpc.aio.insecure_channel(self.target, options=_OPTIONS)
        self.call = self.channel.unary_unary(METHOD)  # bytes in, bytes out: no (de)serializing
        await self.channel.channel_ready()
        if self.stream:
            self._stream = _Stream(self.channel.stream_stream(STREAM_METHOD)(
                metadata=self.metadata))  # fmt: skip

    async def infer(self, payload: Payload) -> str:
        if self.call is None:
            await self.connect(1)
        if self._stream is not None:
            outcome, details = await self._stream.infer(payload.body, self.timeout_s)
            if outcome != "ok":
                self.error_samples.setdefault(outcome, details[:300])
            return outcome
        try:
            await self.call(payload.body, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            details = err.details() or ""
            outcome = outcome_of_code(err.code(), details)
            self.error_samples.setdefault(outcome, f"gRPC {err.code().name}: {details[:300]}")
            return outcome
        return "ok"

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
        if self.channel is not None:
            await self.channel.close()
            self.channel = None


class _Stream:
    """One ``ModelStreamInfer`` stream: writes in turn, a reader resolving waiters by id."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.ids = itertools.count()
        self.waiting: dict[str, asyncio.Future[tuple[str, str]]] = {}
        self.lock = asyncio.Lock()  # one write at a time on a stream
        self.reader = asyncio.ensure_future(self._read())

    async def infer(self, body: bytes, timeout_s: float) -> tuple[str, str]:
        key = str(next(self.ids))
        tagged = key.encode()
        waiter = asyncio.get_running_loop().create_future()
        self.waiting[key] = waiter
        try:
            async with self.lock:
                await self.call.write(body + b"\x1a" + bytes([len(tagged)]) + tagged)
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return "timeout", f"no answer on the stream within {timeout_s:g} s"
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as err:
            return "connection", f"the stream ended: {err}"
        finally:
            self.waiting.pop(key, None)

    async def _read(self) -> None:
        try:
            while (raw := await self.call.read()) is not grpc.aio.EOF:
                answer = pb.ModelStreamInferResponse.FromString(raw)
                waiter = self.waiting.get(answer.infer_response.id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(_stream_outcome(answer.error_message))
        except grpc.aio.AioRpcError as err:
            for waiter in self.waiting.values():
                if not waiter.done():
                    waiter.set_result((outcome_of_code(err.code(), err.details() or ""),
                                       f"gRPC {err.code().name}: {err.details()}"))  # fmt: skip

    async def close(self) -> None:
        self.reader.cancel()
        self.call.cancel()


def _stream_outcome(error: str) -> tuple[str, str]:
    """(outcome, details) of a stream answer: ok, or the outcome of the code its error names."""
    if not error:
        return "ok", ""
    name = error.split(":", 1)[0]
    code = getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)
    return outcome_of_code(code, error), f"gRPC stream: {error}"


def check_grpc_request(target: str, payload: Payload, model: str, token: str | None) -> None:
    """One real request over gRPC is answered, so the run measures the model, not an error."""
    with grpc.insecure_channel(target, options=_OPTIONS) as channel:
        call = channel.unary_unary(METHOD)
        try:
            call(payload.body, timeout=10.0, metadata=_metadata(token))
        except grpc.RpcError as err:
            code, details = err.code(), err.details()
            raise LoadTestError(
                f"a test request to model {model!r} over gRPC at {target} failed ({code.name}: "
                f"{details}); check --grpc-target (the server's --grpc-port) and --inputs"
            ) from None
