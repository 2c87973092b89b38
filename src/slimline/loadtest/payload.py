"""Request bodies from real sample inputs, encoded for the KServe v2 (Open Inference) protocol.

Samples come from a task's calibration data (an example name such as ``mnist``, a task ``.py``
file, or a run directory whose manifest names its task) or from an ``.npz`` of arrays. Each request
carries ``batch_size`` consecutive rows. Bodies are encoded once, before the run, so the generator
spends no time on serialization while it keeps the schedule.

Two encodings:

* ``json``: tensors as JSON lists (``"data": [...]``).
* ``binary``: the binary tensor data extension: a JSON header whose inputs carry
  ``parameters.binary_data_size``, followed by the raw little-endian tensor bytes; the header
  length goes in ``Inference-Header-Content-Length`` (what ``tritonclient`` sends).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from ..errors import LoadTestError, SlimlineError
from ..task import Inputs, load_task, take_samples

__all__ = [
    "Encoding",
    "Payload",
    "build_payloads",
    "encode_request",
    "load_samples",
    "v2_datatype",
]

Encoding = Literal["json", "binary"]

_DATATYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
}


@dataclass(frozen=True)
class Payload:
    """One encoded request body with the headers that describe it."""

    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    rows: int = 1


def v2_datatype(arr: np.ndarray) -> str:
    if arr.dtype.kind in ("U", "S", "O"):
        return "BYTES"
    try:
        return _DATATYPES[str(arr.dtype)]
    except KeyError:
        raise LoadTestError(
            f"sample dtype {arr.dtype} has no KServe v2 datatype; convert it to one of "
            f"{', '.join(_DATATYPES)}"
        ) from None


def load_samples(spec: str, limit: int = 256) -> Inputs:
    """Up to ``limit`` rows of real inputs from ``spec``, tried in this order:

    1. an ``.npz`` file of input arrays;
    2. a run directory (a folder holding ``manifest.json``): its task's inputs;
    3. a task ``.py`` file;
    4. an example name (``slimline examples``).

    A folder without ``manifest.json`` is not a run directory, so a local ``mnist/`` folder does
    not hide the ``mnist`` example. If nothing fits, the error lists every attempt and its reason.
    """
    if spec.endswith(".npz"):
        return _from_npz(Path(spec), limit)
    tried: list[str] = []
    for what, load in _sample_sources(spec):
        if isinstance(load, str):  # this reading does not apply; say why
            tried.append(f"{what}: {load}")
            continue
        try:
            return load(limit)
        except SlimlineError as err:
            tried.append(f"{what}: {err}")
    raise LoadTestError(
        f"cannot load sample inputs from {spec!r}; tried, in order: {'; '.join(tried)}. Give an "
        f".npz, a run directory, a task .py file or an example ({', '.join(_example_names())})"
    )


SampleSource = tuple[str, "Callable[[int], Inputs] | str"]


def _sample_sources(spec: str) -> list[SampleSource]:
    """Each reading of ``spec`` in order: a loader, or why the reading does not apply."""
    path = Path(spec)
    as_path = f"{spec!r} as a path"
    first: SampleSource
    if path.is_dir():
        first = (f"{spec!r} as a run directory", lambda n: _from_run_dir(path, n))
    elif spec.endswith(".py"):
        first = (f"{spec!r} as a task file", lambda n: _from_task(spec, n))
    elif path.exists():
        first = (as_path, "a file that is neither an .npz nor a task .py file")
    else:
        first = (as_path, "no such file or folder")
    as_example = f"{spec!r} as an example name"
    if spec in _example_names():
        return [first, (as_example, lambda n: _from_task(spec, n))]
    if spec.endswith(".py"):
        return [first]
    return [first, (as_example, f"not one of {', '.join(_example_names())}")]


def _example_names() -> list[str]:
    from ..examples import EXAMPLES

    return sorted(EXAMPLES)


def _from_task(spec: str, limit: int) -> Inputs:
    return _checked(take_samples(load_task(spec).calibration_data(), limit), spec)


def _from_npz(path: Path, limit: int) -> Inputs:
    if not path.is_file():
        raise LoadTestError(f"sample file {path} does not exist; give an .npz of input arrays")
    with np.load(path, allow_pickle=False) as npz:
        rows = {k: np.asarray(npz[k])[:limit] for k in npz.files}
    return _checked(rows, str(path))


def _from_run_dir(path: Path, limit: int) -> Inputs:
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise LoadTestError(f"{path} has no manifest.json, so it is not a run directory")
    doc = json.loads(manifest.read_text())
    recipe = doc.get("recipe") or {}
    source = (doc.get("task") or {}).get("source") or recipe.get("task")
    if not source:
        raise LoadTestError(f"{manifest} names no task; pass --inputs with an .npz or task spec")
    samples = recipe.get("samples")
    if samples and str(samples).endswith(".npz"):
        return _from_npz(Path(samples), limit)
    return load_samples(str(source), limit)


def _checked(rows: Inputs, where: str) -> Inputs:
    if not rows:
        raise LoadTestError(f"{where} yielded no sample inputs; the load test needs real inputs")
    counts = {len(v) for v in rows.values()}
    if len(counts) != 1 or 0 in counts:
        raise LoadTestError(f"{where}: inputs have different row counts {sorted(counts)}")
    return rows


def build_payloads(
    samples: Inputs, encoding: Encoding, batch_size: int = 1, limit: int = 64
) -> list[Payload]:
    """Encode up to ``limit`` distinct requests of ``batch_size`` consecutive rows each."""
    n = len(next(iter(samples.values())))
    if batch_size < 1 or batch_size > n:
        raise LoadTestError(f"--batch-size {batch_size} must be between 1 and the {n} sample rows")
    starts = range(0, n - batch_size + 1, batch_size)
    return [
        encode_request({k: v[s : s + batch_size] for k, v in samples.items()}, encoding)
        for s in list(starts)[:limit]
    ]


def encode_request(inputs: Inputs, encoding: Encoding) -> Payload:
    rows = len(next(iter(inputs.values())))
    if encoding == "json":
        doc = {"inputs": [_json_tensor(k, v) for k, v in inputs.items()]}
        body = json.dumps(doc, separators=(",", ":")).encode()
        return Payload(body, {"Content-Type": "application/json"}, rows)
    blobs = [_tensor_bytes(v) for v in inputs.values()]
    header = {
        "inputs": [
            {**_tensor_head(k, v), "parameters": {"binary_data_size": len(b)}}
            for (k, v), b in zip(inputs.items(), blobs, strict=True)
        ],
        "parameters": {"binary_data_output": True},
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(head)),
    }
    return Payload(head + b"".join(blobs), headers, rows)


def _tensor_head(name: str, arr: np.ndarray) -> dict[str, object]:
    return {"name": name, "shape": list(arr.shape), "datatype": v2_datatype(arr)}


def _json_tensor(name: str, arr: np.ndarray) -> dict[str, object]:
    flat = arr.reshape(-1)
    data = [str(x) for x in flat] if v2_datatype(arr) == "BYTES" else flat.tolist()
    return {**_tensor_head(name, arr), "data": data}


def _tensor_bytes(arr: np.ndarray) -> bytes:
    if v2_datatype(arr) == "BYTES":
        parts = [str(x).encode() for x in arr.reshape(-1)]
        return b"".join(struct.pack("<I", len(p)) + p for p in parts)
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
