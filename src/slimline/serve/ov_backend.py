"""The server's OpenVINO backend: the same :class:`~slimline.serve.model.InferenceBackend`
contract as the ONNX Runtime one, so batching, queue policy, metrics and validation are the
server's and identical on both runtimes.

Metadata (names, dtypes, shapes, symbolic dimension names) is read from the ONNX graph itself,
as ONNX Runtime reports it, so the two backends describe a model the same way. Each calling
thread gets its own infer request (calls may overlap, as with an ONNX Runtime session).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFileError
from ..measure.ov import ov_compile, ov_message
from .model import ModelInputError, Tensors, TensorSpec

__all__ = ["OvBackend", "onnx_specs"]


def _tensor_spec(value_info: Any) -> TensorSpec:
    from onnx import helper

    t = value_info.type.tensor_type
    try:
        dtype = str(np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)))
    except (KeyError, TypeError):
        raise ModelFileError(
            f"tensor {value_info.name!r} has an element type the server cannot carry; serve a "
            "model with numeric or bool inputs and outputs"
        ) from None
    dims = list(t.shape.dim) if t.HasField("shape") else []
    shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in dims)
    names = tuple(d.dim_param or None for d in dims)
    return TensorSpec(value_info.name, dtype, shape, names)


def onnx_specs(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Input and output specs as the ONNX graph declares them (initializers excluded)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    inputs = [_tensor_spec(v) for v in model.graph.input if v.name not in inits]
    return inputs, [_tensor_spec(v) for v in model.graph.output]


class OvBackend:
    """An OpenVINO compiled model on the CPU; ``threads`` inference threads per call."""

    platform = "openvino_onnx"

    def __init__(self, path: Path, threads: int = 1) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"ONNX file {path} does not exist; check the path")
        self.compiled = ov_compile(self.path, threads, user_model=True)
        self.inputs, self.outputs = onnx_specs(self.path)
        ports = {p.get_any_name(): p for p in self.compiled.outputs if p.get_names()}
        self._ports = [ports[o.name] for o in self.outputs]
        self._local = threading.local()

    def _request(self) -> Any:
        req = getattr(self._local, "request", None)
        if req is None:
            req = self._local.request = self.compiled.create_infer_request()
        return req

    def run(self, inputs: Tensors) -> Tensors:
        feed = {k: np.ascontiguousarray(v) for k, v in inputs.items()}
        try:
            result = self._request().infer(feed)
        except RuntimeError as err:  # shapes the graph cannot take (checked by OpenVINO)
            raise ModelInputError(ov_message(err)[:300]) from None
        return {
            o.name: np.asarray(result[p]) for o, p in zip(self.outputs, self._ports, strict=True)
        }
