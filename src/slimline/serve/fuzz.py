"""Hypothesis strategies for malformed (and some valid) v2 inference requests.

Used by the test suite (a few hundred examples) and by ``bench/serve_fuzz.py`` (10,000+). Needs
``hypothesis`` (the ``dev`` extra). A request is ``(body bytes, headers)``; the server must
answer every one with a status below 500 and stay alive.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from .protocol import HEADER_LENGTH, V2_TO_NP

__all__ = ["FuzzRequest", "requests"]

FuzzRequest = tuple[bytes, dict[str, str]]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=24,
)
_datatypes = st.sampled_from([*V2_TO_NP, "BYTES", "fp32", "", "FP8"]) | st.text(max_size=6)
_shapes = st.lists(st.integers(min_value=-2, max_value=12), max_size=5) | _json
_numbers = st.lists(
    st.integers(min_value=-300, max_value=300) | st.floats(width=32, allow_nan=True), max_size=64
)


def _tensor(names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {},
        optional={
            "name": st.sampled_from(names) | st.text(max_size=6) | _scalars,
            "shape": _shapes,
            "datatype": _datatypes,
            "data": _numbers | st.lists(_numbers, max_size=4) | _json,
            "parameters": st.fixed_dictionaries(
                {}, optional={"binary_data_size": st.integers(-4, 512) | _scalars,
                              "shared_memory_region": st.text(max_size=4)}
            ) | _json,
        },
    )  # fmt: skip


def _document(names: list[str], outputs: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"inputs": st.lists(_tensor(names), max_size=3) | _json},
        optional={
            "id": st.text(max_size=8) | _scalars,
            "parameters": st.fixed_dictionaries(
                {}, optional={"binary_data_output": _scalars, "timeout": _scalars}
            ) | _json,
            "outputs": st.lists(
                st.fixed_dictionaries(
                    {"name": st.sampled_from(outputs) | st.text(max_size=4)},
                    optional={"parameters": _json},
                ),
                max_size=3,
            ) | _json,
        },
    )  # fmt: skip


@st.composite
def _valid_ish(draw: st.DrawFn, spec: dict[str, tuple[str, list[int]]]) -> dict[str, Any]:
    """A request with the model's names and datatypes, plausible shapes, possibly off by one."""
    inputs = []
    free = [draw(st.integers(1, 4)) for _ in range(8)]  # free dims agree across inputs
    for name, (datatype, shape) in spec.items():
        dims = [free[i] if d < 0 else d for i, d in enumerate(shape)]
        if draw(st.integers(0, 2)) == 0:
            dims[draw(st.integers(0, len(dims) - 1))] += draw(st.sampled_from([-1, 1]))
        count = max(0, _prod(dims)) + draw(st.sampled_from([0, 0, 0, -1, 1]))
        element = st.booleans() if datatype == "BOOL" else st.integers(0, 3)
        data = draw(st.lists(element, min_size=max(0, count), max_size=max(0, count)))
        inputs.append({"name": name, "shape": dims, "datatype": datatype, "data": data})
    return {"inputs": inputs}


def _prod(dims: list[int]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


_content_types = st.sampled_from(
    ["application/json", "application/octet-stream", "text/plain", "multipart/form-data",
     "application/json; charset=utf-8", ""]
)  # fmt: skip


@st.composite
def _headers(draw: st.DrawFn, json_len: int, total: int) -> dict[str, str]:
    headers: dict[str, str] = {}
    if draw(st.booleans()):
        headers["content-type"] = draw(_content_types)
    if total > json_len or draw(st.integers(0, 9)) == 0:
        headers[HEADER_LENGTH] = draw(
            st.sampled_from([str(json_len), str(json_len)])
            | st.integers(-5, total + 5).map(str)
            | st.text(max_size=4)
        )
    if draw(st.integers(0, 14)) == 0:
        headers["content-encoding"] = draw(st.sampled_from(["gzip", "deflate", "br", "x"]))
    if draw(st.integers(0, 9)) == 0:
        headers["x-request-timeout-ms"] = draw(st.sampled_from(["0", "-1", "abc", "1e9", "60000"]))
    return {k: v for k, v in headers.items() if v.isprintable() and v.isascii()}


@st.composite
def requests(
    draw: st.DrawFn, spec: dict[str, tuple[str, list[int]]], outputs: list[str]
) -> FuzzRequest:
    """``spec``: the model's inputs as ``{name: (v2 datatype, shape with -1)}``."""
    names = list(spec)
    kind = draw(st.integers(0, 9))
    if kind == 0:
        head = draw(st.binary(max_size=256))
    elif kind == 1:
        head = json.dumps(draw(_json)).encode()
    elif kind <= 4:
        head = json.dumps(draw(_valid_ish(spec))).encode()
    else:
        head = json.dumps(draw(_document(names, outputs))).encode()
    tail = draw(st.binary(max_size=64)) if draw(st.integers(0, 4)) == 0 else b""
    body = head + tail
    return body, draw(_headers(len(head), len(body)))
