"""The Open Inference Protocol (KServe v2) over HTTP: decode, validate, encode. No I/O here.

Requests carry tensors as JSON (``"data"``, flat or nested, row-major) or, with the binary tensor
data extension, as raw little-endian bytes after a JSON header whose length is given by the
``Inference-Header-Content-Length`` HTTP header (``"parameters": {"binary_data_size": n}`` on
each binary input). Responses use binary outputs when the request asks for them (per output
``"binary_data": true`` or request-level ``"binary_data_output": true``).

Every problem with a request raises :class:`ProtocolError` with an HTTP status and a one-line
message naming the input at fault and the fix; nothing here ever produces a 5xx.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from ..errors import ProtocolError
from ..tensors import same_value
from .model import ServedModel, TensorSpec

__all__ = [
    "HEADER_LENGTH",
    "InferRequest",
    "ProtocolError",
    "RequestedOutput",
    "decode_body",
    "encode_response",
    "model_metadata",
    "parse_infer_request",
    "validate_inputs",
]

HEADER_LENGTH = "Inference-Header-Content-Length"
V2_TO_NP = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
}
NP_TO_V2 = {v: k for k, v in V2_TO_NP.items()}
Tensors = dict[str, np.ndarray]
# looked up per request: numpy builds a dtype from its name, or swaps its byte order, in about
# a microsecond each time
_DTYPES = {name: np.dtype(name) for name in NP_TO_V2}
_WIRE_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in NP_TO_V2}
_WIRE_OF_DTYPE = {_DTYPES[name]: wire for name, wire in _WIRE_DTYPES.items()}
_V2_OF_DTYPE = {_DTYPES[name]: v2 for name, v2 in NP_TO_V2.items()}


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool | None  # None: follow the request-level default


@dataclass
class InferRequest:
    id: str | None
    inputs: Tensors
    outputs: list[RequestedOutput] | None
    binary_output: bool
    timeout_s: float | None


# -- body ----------------------------------------------------------------------------------
def decode_body(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding`` (gzip/deflate), never inflating past ``limit`` bytes."""
    enc = (encoding or "identity").strip().lower()
    if enc == "identity":
        return body
    if enc not in ("gzip", "deflate"):
        raise ProtocolError(
            f"Content-Encoding {enc!r} is not supported; send identity, gzip or deflate", 415
        )
    inflater = zlib.decompressobj(wbits=31 if enc == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error:
        raise ProtocolError(f"the body is not valid {enc} data; compress it again") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise ProtocolError(f"the inflated body exceeds the {limit}-byte limit; send less", 413)
    return out


# -- request ------------------------------------------------------------------------------
def parse_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    """Decode a v2 inference request (JSON or JSON + binary tensor data)."""
    json_part, binary = _split_body(body, header_length)
    doc = _load_json(json_part)
    params = _mapping(doc.get("parameters"), "request parameters")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError('"inputs" must be a non-empty list of tensors; see the v2 protocol')
    inputs: Tensors = {}
    offset = 0
    for i, raw in enumerate(raw_inputs):
        name, arr, offset = _parse_input(raw, i, binary, offset)
        if name in inputs:
            raise ProtocolError(f"input {name!r} appears twice; send each input once")
        inputs[name] = arr
    if offset != len(binary):
        raise ProtocolError(
            f"{len(binary) - offset} bytes of binary data follow the inputs unused; make "
            "binary_data_size match each input's data"
        )
    return InferRequest(
        id=_request_id(doc.get("id")),
        inputs=inputs,
        outputs=_parse_outputs(doc.get("outputs")),
        binary_output=_flag(params.get("binary_data_output", False), "binary_data_output"),
        timeout_s=_timeout(params.get("timeout")),
    )


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes | memoryview, bytes]:
    """The JSON header and the binary part; views of ``body``, not copies."""
    if header_length is None:
        return body, b""
    try:
        n = int(header_length)
    except ValueError:
        n = -1
    if not 0 <= n <= len(body):
        raise ProtocolError(
            f"{HEADER_LENGTH} is {header_length!r} for a {len(body)}-byte body; it must be "
            "the byte length of the JSON header"
        )
    view = memoryview(body)
    return view[:n], view[n:]  # type: ignore[return-value]  # read like bytes from here on


def _load_json(raw: bytes | memoryview) -> dict[str, Any]:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:  # the standard parser also reads NaN/Infinity tokens
        try:
            doc = json.loads(bytes(raw))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            kind = "too deeply nested" if isinstance(err, RecursionError) else "not valid JSON"
            raise ProtocolError(
                f"the request body is {kind}; send a v2 inference request object"
            ) from None
    if not isinstance(doc, dict):
        raise ProtocolError(
            f'the request body is a JSON {type(doc).__name__}; send an object with "inputs"'
        )
    return doc


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f'"{what}" must be true or false, got {value!r}')
    return value


def _request_id(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ProtocolError('"id" must be a string; send the request id as text')


def _timeout(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 3_600_000_000:
        raise ProtocolError(
            f"parameters.timeout is {value!r}; give a whole number of microseconds in 1..3600000000"
        )
    return value / 1e6


def _parse_input(raw: Any, i: int, binary: bytes, offset: int) -> tuple[str, np.ndarray, int]:
    if not isinstance(raw, dict):
        raise ProtocolError(f"inputs[{i}] must be an object with name, shape, datatype, data")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f'inputs[{i}] has no "name"; name every input tensor')
    shape = _shape(raw.get("shape"), name)
    dtype = _dtype(raw.get("datatype"), name)
    params = _mapping(raw.get("parameters"), f"parameters of input {name!r}")
    if any(k.startswith("shared_memory") for k in params):
        raise ProtocolError(
            f"input {name!r} uses shared memory, which this server does not offer; send the "
            "data in the body"
        )
    count = math.prod(shape)
    if "binary_data_size" in params:
        size = params["binary_data_size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ProtocolError(f"input {name!r}: binary_data_size must be a byte count")
        need = count * _DTYPES[dtype].itemsize
        if size != need:
            raise ProtocolError(
                f"input {name!r}: binary_data_size is {size} bytes but shape {shape} of "
                f"{NP_TO_V2[dtype]} needs {need}; fix the shape or the data"
            )
        if offset + size > len(binary):
            raise ProtocolError(
                f"input {name!r}: the body holds {len(binary) - offset} bytes of binary data, "
                f"{size} expected; send the whole tensor"
            )
        data = np.frombuffer(binary, dtype=_WIRE_DTYPES[dtype], count=count, offset=offset)
        return name, data.astype(_DTYPES[dtype], copy=False).reshape(shape), offset + size
    if "data" not in raw:
        raise ProtocolError(f'input {name!r} has neither "data" nor binary_data_size; send one')
    return name, _json_tensor(raw["data"], shape, dtype, name), offset


def _shape(value: Any, name: str) -> list[int]:
    # parsed JSON holds no int subclass but bool, so ``type(d) is int`` excludes bools alone
    if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
        raise ProtocolError(
            f'input {name!r}: "shape" must be a list of non-negative integers, got {value!r}'
        )
    return value


def _dtype(value: Any, name: str) -> str:
    if value == "BYTES":
        raise ProtocolError(f"input {name!r} is BYTES; this server serves numeric tensors only")
    if value not in V2_TO_NP:
        raise ProtocolError(
            f"input {name!r}: datatype {value!r} is unknown; use one of {', '.join(V2_TO_NP)}"
        )
    return V2_TO_NP[value]


def _json_tensor(data: Any, shape: list[int], dtype: str, name: str) -> np.ndarray:
    target = np.dtype(dtype)
    try:
        arr = np.asarray(data)
    except (ValueError, TypeError, OverflowError, RecursionError):
        arr = None
    if arr is None or arr.dtype.kind not in "biuf":
        raise ProtocolError(
            f'input {name!r}: "data" must be a (nested) list of numbers of one shape; '
            "check for strings, nulls or ragged rows"
        )
    if target.kind == "b" and arr.dtype.kind != "b" and arr.size:
        raise ProtocolError(f"input {name!r} is BOOL; send true/false values")
    if target.kind in "iu" and arr.dtype.kind == "f":
        raise ProtocolError(f"input {name!r} is {NP_TO_V2[dtype]}; send whole numbers")
    count = math.prod(shape)
    if arr.size != count:
        raise ProtocolError(
            f"input {name!r}: shape {shape} needs {count} elements, the data has {arr.size}; "
            "make shape and data agree"
        )
    if target.kind in "iu" and arr.size:
        info = np.iinfo(target)
        if arr.min() < info.min or arr.max() > info.max:
            raise ProtocolError(
                f"input {name!r}: values out of range for {NP_TO_V2[dtype]} "
                f"[{info.min}, {info.max}]"
            )
    with np.errstate(over="ignore"):
        return arr.astype(target).reshape(shape)


def _parse_outputs(value: Any) -> list[RequestedOutput] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ProtocolError('"outputs" must be a list of {"name": ...} objects')
    outs = []
    for i, raw in enumerate(value):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise ProtocolError(f'outputs[{i}] must be an object with a "name"')
        params = _mapping(raw.get("parameters"), f"parameters of output {raw['name']!r}")
        if "classification" in params or any(k.startswith("shared_memory") for k in params):
            raise ProtocolError(
                f"output {raw['name']!r}: classification and shared memory are not offered; "
                "ask for the raw tensor"
            )
        binary = params.get("binary_data")
        outs.append(
            RequestedOutput(raw["name"], None if binary is None else _flag(binary, "binary_data"))
        )
    return outs


# -- validation against the model -----------------------------------------------------------
def validate_inputs(
    model: ServedModel, inputs: Tensors, *, max_batch: int, allow_nonfinite: bool
) -> Tensors:
    """Names, dtypes, shapes (batch dimension free), finiteness: a 400 naming the input. Returns
    the inputs the model runs on: without those frozen into it (sent with the frozen value)."""
    specs = {s.name: s for s in model.backend.inputs}
    inputs = _drop_frozen(model, inputs, specs)
    for name in inputs:
        if name not in specs:
            raise ProtocolError(
                f"model {model.name!r} has no input {name!r}; its inputs are {', '.join(specs)}"
            )
    for spec in specs.values():
        if spec.name not in inputs:
            raise ProtocolError(
                f"model {model.name!r} needs input {spec.name!r} ({NP_TO_V2[spec.dtype]}, shape "
                f"{wire_shape(spec)}); add it"
            )
        _check_tensor(model, spec, inputs[spec.name], max_batch, allow_nonfinite)
    _check_shared_dims(model, inputs)
    return inputs


def _drop_frozen(model: ServedModel, inputs: Tensors, specs: dict[str, Any]) -> Tensors:
    out: Tensors = {}
    for name, arr in inputs.items():
        frozen = model.frozen.get(name)
        if name in specs or frozen is None:
            out[name] = arr
        elif not same_value(arr, frozen):
            raise ProtocolError(
                f"model {model.name!r} was built for input {name!r} = {frozen.tolist()} (frozen "
                f"into it as a constant input), but the request sends "
                f"{np.asarray(arr).tolist()!s:.80}; send {frozen.tolist()} or leave {name!r} out"
            )
    return out


def _check_shared_dims(model: ServedModel, inputs: Tensors) -> None:
    """Inputs whose dimensions carry the same symbolic name (e.g. ``seq``) must agree."""
    seen: dict[str, tuple[int, str]] = {}
    for spec in model.backend.inputs:
        for i, dim_name in enumerate(spec.dim_names):
            if dim_name is None:
                continue
            size = inputs[spec.name].shape[i]
            first = seen.setdefault(dim_name, (size, spec.name))
            if first[0] != size:
                raise ProtocolError(
                    f"inputs {first[1]!r} and {spec.name!r} disagree on dimension {dim_name!r} "
                    f"({first[0]} vs {size}); send them with equal sizes"
                )


def _check_tensor(
    model: ServedModel, spec: TensorSpec, arr: np.ndarray, max_batch: int, allow_nonfinite: bool
) -> None:
    if arr.dtype != _DTYPES.get(spec.dtype) and arr.dtype != np.dtype(spec.dtype):
        raise ProtocolError(
            f"input {spec.name!r} is {NP_TO_V2.get(arr.dtype.name, arr.dtype.name)} but model "
            f"{model.name!r} takes {NP_TO_V2[spec.dtype]}; send datatype {NP_TO_V2[spec.dtype]}"
        )
    if len(arr.shape) != len(spec.shape):
        want = wire_shape(spec)
        raise ProtocolError(
            f"input {spec.name!r} has shape {list(arr.shape)}; model {model.name!r} takes "
            f"{want} ({len(want)} dimensions)"
        )
    for i, (got, need) in enumerate(zip(arr.shape, spec.shape, strict=True)):
        if got == 0:
            raise ProtocolError(f"input {spec.name!r}: dimension {i} is 0; send at least 1")
        if need is not None and got != need:
            raise ProtocolError(
                f"input {spec.name!r} has shape {list(arr.shape)}; model {model.name!r} takes "
                f"{wire_shape(spec)} (dimension {i} must be {need})"
            )
    if model.batchable and arr.shape[0] > max_batch:
        raise ProtocolError(
            f"input {spec.name!r} has batch size {arr.shape[0]}, above max_batch_size "
            f"{max_batch}; split the request"
        )
    if not allow_nonfinite and arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise ProtocolError(
            f"input {spec.name!r} contains NaN or Inf; send finite values (or start the server "
            "with --allow-nonfinite)"
        )


def wire_shape(spec: TensorSpec) -> list[int]:
    return [-1 if d is None else d for d in spec.shape]


# -- responses ------------------------------------------------------------------------------
def model_metadata(model: ServedModel) -> dict[str, Any]:
    def tensors(specs: list[TensorSpec]) -> list[dict[str, Any]]:
        return [
            {"name": s.name, "datatype": NP_TO_V2[s.dtype], "shape": wire_shape(s)} for s in specs
        ]

    return {
        "name": model.name,
        "versions": [model.version],
        "platform": model.backend.platform,
        "inputs": tensors(model.backend.inputs),
        "outputs": tensors(model.backend.outputs),
    } | (
        {"parameters": {"constant_inputs": {k: v.tolist() for k, v in model.frozen.items()}}}
        if model.frozen
        else {}
    )


def encode_response(
    model: ServedModel,
    req: InferRequest,
    outputs: Tensors,
    parameters: dict[str, Any] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The response body and headers; binary outputs follow the JSON header. ``parameters``
    become the response's own (e.g. which tier of a cascade answered)."""
    wanted = req.outputs or [RequestedOutput(n, None) for n in outputs]
    tensors: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    finite = True
    for out in wanted:
        if out.name not in outputs:
            raise ProtocolError(
                f"model {model.name!r} has no output {out.name!r}; its outputs are "
                f"{', '.join(outputs)}"
            )
        arr = np.asarray(outputs[out.name])
        entry: dict[str, Any] = {
            "name": out.name,
            "datatype": _V2_OF_DTYPE.get(arr.dtype) or NP_TO_V2.get(arr.dtype.name, "BYTES"),
            "shape": list(arr.shape),
        }
        if req.binary_output if out.binary is None else out.binary:
            wire = _WIRE_OF_DTYPE.get(arr.dtype)
            if wire is None:
                wire = arr.dtype.newbyteorder("<")
            raw = np.ascontiguousarray(arr, dtype=wire).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = arr.ravel().tolist()
            finite = finite and (arr.dtype.kind != "f" or bool(np.isfinite(arr).all()))
        tensors.append(entry)
    doc: dict[str, Any] = {"model_name": model.name, "model_version": model.version}
    if req.id is not None:
        doc["id"] = req.id
    if parameters:
        doc["parameters"] = parameters
    doc["outputs"] = tensors
    head = _dumps(doc, finite)
    if not chunks:
        return head, {"content-type": "application/json"}
    headers = {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(head))}
    return b"".join([head, *chunks]), headers


def _dumps(doc: dict[str, Any], finite: bool) -> bytes:
    """orjson when every value is finite; else the standard encoder, which writes NaN/Infinity
    (as Triton does) where orjson would write null."""
    if finite:
        return orjson.dumps(doc)
    return json.dumps(doc, separators=(",", ":")).encode()


def check_requested_outputs(model: ServedModel, req: InferRequest) -> None:
    """Reject unknown output names before the request runs."""
    names = [s.name for s in model.backend.outputs]
    for out in req.outputs or []:
        if out.name not in names:
            raise ProtocolError(
                f"model {model.name!r} has no output {out.name!r}; its outputs are "
                f"{', '.join(names)}"
            )
