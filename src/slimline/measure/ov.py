"""OpenVINO, the second CPU runtime: it reads the same ONNX candidates as ONNX Runtime (FP32 and
QDQ INT8, whose QuantizeLinear/DequantizeLinear pairs it runs on its INT8 kernels) and NNCF's
OpenVINO IR (``.xml`` beside its ``.bin``).

A compiled model is pinned like an ONNX Runtime session: ``INFERENCE_NUM_THREADS`` = the
target's threads, the ``LATENCY`` hint (one stream), no hyper-threading, and FP32 inference
precision: on a CPU with AMX or AVX512-BF16 OpenVINO would otherwise run an FP32 model in
bfloat16, and the comparison would no longer be between the same models.

The package is optional (``pip install 'slimline[openvino]'``); :func:`require_openvino` turns
its absence into an error that names the extra.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import CandidateError, ModelFileError, RuntimeMissingError
from ..signature import ModelInput, Signature
from ..tensors import Inputs, frozen_inputs
from .rowwise import RowwiseRunner

__all__ = [
    "OV_EXTRA",
    "NamedCompiled",
    "OvRunner",
    "ov_compile",
    "ov_compile_named",
    "ov_message",
    "ov_param_count",
    "ov_settings",
    "ov_version",
    "port_dims",
    "port_dtype",
    "port_name",
    "require_openvino",
]

OV_EXTRA = "pip install 'slimline[openvino]'"


def require_openvino() -> Any:
    """The ``openvino`` module, or a one-line error naming the extra to install."""
    try:
        import openvino
    except ImportError:
        raise RuntimeMissingError(
            "target.runtime openvino (or auto) needs the openvino package, which is not "
            f"installed: {OV_EXTRA} (or choose runtime: onnxruntime)"
        ) from None
    return openvino


def ov_version() -> str:
    return str(require_openvino().__version__).split("-")[0]


def ov_settings(threads: int, *, profile: bool = False, streams: int = 1) -> dict[str, Any]:
    """The compile properties, by their OpenVINO names (recorded in the manifest as they are).

    ``streams`` infer requests run at once, each on ``threads`` threads: a server's instances.
    The latency hint alone makes one stream, on which concurrent requests wait in turn."""
    settings: dict[str, Any] = {
        "INFERENCE_NUM_THREADS": threads * streams,
        "PERFORMANCE_HINT": "LATENCY",
        "ENABLE_HYPER_THREADING": False,
        "INFERENCE_PRECISION_HINT": "f32",
    }
    if streams > 1:
        settings["NUM_STREAMS"] = streams
    if profile:
        settings["PERF_COUNT"] = True
    return settings


def ov_message(err: BaseException) -> str:
    """OpenVINO's error on one line: its first lines (the C++ source location left out)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("Exception from src", "Check '"))]
    text = " ".join(useful or lines) or type(err).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def ov_compile(
    path: Path, threads: int, *, user_model: bool = False, profile: bool = False, streams: int = 1
) -> Any:
    """:func:`ov_compile_named`'s compiled model alone."""
    return ov_compile_named(
        path, threads, user_model=user_model, profile=profile, streams=streams
    ).compiled


class NamedCompiled(NamedTuple):
    """A compiled model and its ports' names as the file declares them (the ONNX graph's input
    and output names, the IR's). The compiled model's ports can carry more names than the file
    declared (OpenVINO merges an output's name with the name of the tensor it fused into it,
    e.g. ``{'/model/Gather_4_output_0', 'probability'}``), so the names are read before
    compiling; the ports keep their order."""

    compiled: Any
    input_names: list[str]
    output_names: list[str]


def ov_compile_named(
    path: Path, threads: int, *, user_model: bool = False, profile: bool = False, streams: int = 1
) -> NamedCompiled:
    """A CPU-compiled OpenVINO model for ``path`` (ONNX or IR), pinned to ``threads`` per
    stream, with ``streams`` streams (see :func:`ov_settings`).

    A load failure blames the file's author, as for ONNX Runtime: the user's model
    (:class:`ModelFileError`) or a candidate slimline wrote (:class:`CandidateError`: that
    (runtime, candidate) pair is rejected, the other runtime's result stands)."""
    ov = require_openvino()
    path = Path(path)
    if not path.is_file():
        if user_model:
            raise ModelFileError(f"model file {path} does not exist; check the path")
        raise CandidateError(f"OpenVINO cannot load {path.name}: the file does not exist")
    core = ov.Core()
    try:
        model = core.read_model(str(path))
        inputs = [port_name(p, i, "input") for i, p in enumerate(model.inputs)]
        outputs = [port_name(p, i, "output") for i, p in enumerate(model.outputs)]
        compiled = core.compile_model(
            model, "CPU", ov_settings(threads, profile=profile, streams=streams)
        )
        return NamedCompiled(compiled, inputs, outputs)
    except Exception as err:  # OpenVINO raises RuntimeError/GeneralFailure with C++ text
        why = ov_message(err)
        if user_model:
            raise ModelFileError(
                f"OpenVINO {ov_version()} cannot load the model {path} ({why}); re-export it "
                "or serve it on onnxruntime"
            ) from None
        raise CandidateError(
            f"OpenVINO cannot load {path.name}, a candidate slimline wrote: {why}"
        ) from None


def ov_param_count(path: Path) -> int:
    """Elements in the constants of an OpenVINO model file (its weights, INT8 ones included)."""
    model = require_openvino().Core().read_model(str(path))
    return int(
        sum(
            int(np.prod(list(op.get_output_shape(0)) or [1]))
            for op in model.get_ops()
            if op.get_type_name() == "Constant"
        )
    )


def port_dtype(port: Any) -> str:
    return str(np.dtype(port.get_element_type().to_dtype()))


def port_dims(port: Any) -> list[int | None]:
    return [d.get_length() if d.is_static else None for d in port.get_partial_shape()]


def port_name(port: Any, index: int, prefix: str) -> str:
    names = port.get_names()
    return port.get_any_name() if names else f"{prefix}{index}"


class OvRunner(RowwiseRunner):
    """The :class:`~slimline.measure.runners.OrtRunner` contract (batching by signature, input
    checks, primary output) on an OpenVINO compiled model. One infer request per calling
    thread, so calls may overlap."""

    def __init__(
        self,
        name: str,
        path: Path,
        threads: int,
        signature: Signature | None = None,
        *,
        user_model: bool = False,
    ) -> None:
        self.name = name
        self.compiled, self.input_names, self.output_names = ov_compile_named(
            path, threads, user_model=user_model
        )
        self.spec = {
            n: (port_dtype(p), port_dims(p))
            for n, p in zip(self.input_names, self.compiled.inputs, strict=True)
        }
        self.signature = signature
        self.frozen = frozen_inputs(path)
        self._checked = False
        self._local = threading.local()

    @property
    def model_inputs(self) -> dict[str, Any]:
        return {n: ModelInput(d, list(s)) for n, (d, s) in self.spec.items()}

    @property
    def output_dims(self) -> dict[str, list[Any]]:
        return {
            n: port_dims(p) for n, p in zip(self.output_names, self.compiled.outputs, strict=True)
        }

    def _request(self) -> Any:
        req = getattr(self._local, "request", None)
        if req is None:
            req = self._local.request = self.compiled.create_infer_request()
        return req

    def call(self, inputs: Inputs) -> dict[str, np.ndarray]:
        feed = {k: np.ascontiguousarray(v) for k, v in inputs.items()}
        result = self._request().infer(feed)  # copies the outputs (share_outputs=False)
        return {
            n: np.asarray(result[p])
            for n, p in zip(self.output_names, self.compiled.outputs, strict=True)
        }
