"""What the server runs: one small backend interface, an ONNX Runtime backend, an OpenVINO
backend, and a fake.

``InferenceBackend.run(inputs) -> outputs`` takes and returns ``{name: np.ndarray}`` with the
batch on axis 0. Its metadata (names, dtypes, shapes with ``None`` for free dimensions) is read
from the model itself. :func:`load_served_models` turns command-line paths (a run directory or an
``.onnx`` file) into :class:`ServedModel` objects.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..candidate import is_ir
from ..cpu import recorded_saturates
from ..edge.setting import MemorySetting, session_path
from ..errors import ManifestError, ModelFileError, ModelInputError, ServeError
from ..measure.ov import ov_compile, ov_message, port_dims, port_dtype, port_name
from ..measure.runners import ORT_TO_NP
from ..tensors import frozen_inputs

log = logging.getLogger("slimline.serve")

# the steps whose models run INT8 kernels (steps.kinds_producing("onnx-int8"), named here so that
# serving does not load every step and torch with it; a test keeps the two equal)
INT8_STEPS = frozenset({"quantize", "nncf", "qat"})

__all__ = [
    "FakeBackend",
    "InferenceBackend",
    "ModelInputError",
    "OrtBackend",
    "OvBackend",
    "ServedModel",
    "TensorSpec",
    "load_served_models",
    "make_backend",
    "ort_serving_session",
    "resolve_model_path",
]

Tensors = dict[str, np.ndarray]
Processor = Callable[[Tensors], Tensors]


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output: numpy dtype name and shape (``None`` = any size)."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    dim_names: tuple[str | None, ...] = ()  # symbolic names; inputs sharing one must agree

    @property
    def batch_dim(self) -> int | None:
        """The leading dimension: ``None`` when free (batchable), else its fixed size."""
        return self.shape[0] if self.shape else None


class InferenceBackend(Protocol):
    """One runtime. ``run`` may be called from several threads at once."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    platform: str

    def run(self, inputs: Tensors) -> Tensors: ...


class OrtBackend:
    """An ONNX Runtime session; ``threads`` intra-op threads per call, calls may overlap."""

    platform = "onnxruntime_onnx"

    def __init__(
        self,
        path: Path,
        threads: int = 1,
        *,
        spinning: bool = False,
        memory: MemorySetting | None = None,
    ) -> None:
        self.path = Path(path)
        self.memory = memory
        self.session = ort_serving_session(self.path, threads, spinning=spinning, memory=memory)
        self._run_options = memory.run_options() if memory is not None else None
        self.inputs = [_spec(a) for a in self.session.get_inputs()]
        self.outputs = [_spec(a) for a in self.session.get_outputs()]
        self._output_names = [o.name for o in self.outputs]

    def run(self, inputs: Tensors) -> Tensors:
        from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

        try:
            values = self.session.run(self._output_names, inputs, self._run_options)
        except InvalidArgument as err:
            first = str(err).strip().splitlines()[0][:300]
            raise ModelInputError(first) from None
        return dict(zip(self._output_names, values, strict=True))


def ort_serving_session(
    path: Path, threads: int, *, spinning: bool = False, memory: MemorySetting | None = None
) -> Any:
    """An ONNX Runtime CPU session for serving: ``threads`` intra-op threads, full graph
    optimization, and (by default) no spin-waiting, so idle inference threads leave the cores
    to the event loop and to the other instances. A ``memory`` setting (a memory profile's
    choice) sets the arena, memory patterns, execution mode and threads instead."""
    import onnxruntime as ort

    if not path.is_file():
        raise ModelFileError(f"ONNX file {path} does not exist; check the path")
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if memory is not None:
        memory.apply(so)
    try:
        path = session_path(path, memory)
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as err:  # ORT raises its own Fail/InvalidGraph/... types
        first = str(err).strip().splitlines()[0][:200]
        raise ModelFileError(
            f"ONNX Runtime cannot load {path} ({first}); serve a valid ONNX model"
        ) from None


def _spec(arg: Any) -> TensorSpec:
    if arg.type not in ORT_TO_NP:
        raise ModelFileError(
            f"tensor {arg.name!r} has type {arg.type}, which the server cannot carry; "
            "serve a model with numeric or bool inputs and outputs"
        )
    dims = list(arg.shape or [])
    shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in dims)
    names = tuple(d if isinstance(d, str) and d else None for d in dims)
    return TensorSpec(arg.name, ORT_TO_NP[arg.type], shape, names)


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


def ir_specs(compiled: Any) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Input and output specs of a compiled OpenVINO IR, as its ports declare them (an IR keeps
    no symbolic dimension names: a free dimension is ``None``)."""

    def specs(ports: Any, prefix: str) -> list[TensorSpec]:
        return [
            TensorSpec(port_name(p, i, prefix), port_dtype(p), tuple(port_dims(p)))
            for i, p in enumerate(ports)
        ]

    return specs(compiled.inputs, "input"), specs(compiled.outputs, "output")


class OvBackend:
    """An OpenVINO compiled model on the CPU; ``threads`` inference threads per call. Its
    metadata (names, dtypes, shapes, symbolic dimension names) is read from the ONNX graph, as
    ONNX Runtime reports it, so both backends describe a model the same way; each calling
    thread gets its own infer request (calls may overlap, as with an ONNX Runtime session).
    ``streams`` (the server's instances) requests run at once; more wait for a stream."""

    platform = "openvino_onnx"

    def __init__(self, path: Path, threads: int = 1, streams: int = 1) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"ONNX file {path} does not exist; check the path")
        self.compiled = ov_compile(self.path, threads, user_model=True, streams=streams)
        # an IR (a run's NNCF pick) has no ONNX graph to read: its compiled ports say it
        self.inputs, self.outputs = (
            ir_specs(self.compiled) if is_ir(self.path) else onnx_specs(self.path)
        )
        # a compiled port can carry more names than the file declared (a fused tensor's too)
        ports = {n: p for p in self.compiled.outputs for n in p.get_names()}
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


class FakeBackend:
    """A backend for tests: ``fn(inputs) -> outputs`` after ``delay_s``; records each batch."""

    platform = "fake"

    def __init__(
        self,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        fn: Callable[[Tensors], Tensors],
        delay_s: float = 0.0,
    ) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self.fn = fn
        self.delay_s = delay_s
        self.batches: list[int] = []
        self._lock = threading.Lock()

    def run(self, inputs: Tensors) -> Tensors:
        with self._lock:
            self.batches.append(len(next(iter(inputs.values()))))
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.fn(inputs)


@dataclass
class ServedModel:
    """A model under its served name, with optional pre/post-processing (own thread pool)."""

    name: str
    backend: InferenceBackend
    version: str = "1"
    preprocess: Processor | None = None
    postprocess: Processor | None = None
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    cascade: Any = None  # a serve.cascade.Cascade: unsure rows go to a cloud model
    # inputs frozen into the model (its file's metadata): a request may still send them, with
    # the frozen value only, and they are dropped before the model runs
    frozen: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def batchable(self) -> bool:
        """True when every input's leading dimension is free, so requests can be stacked."""
        return all(s.shape and s.batch_dim is None for s in self.backend.inputs)

    def fixed_batch(self) -> int | None:
        """The model's fixed leading size when it is not batchable (``1`` for rank-0 inputs)."""
        if self.batchable:
            return None
        dims = {s.batch_dim for s in self.backend.inputs if s.shape}
        fixed = next(iter(dims)) if len(dims) == 1 else None
        return fixed if fixed is not None else 1


def resolve_model_path(path: Path) -> tuple[str, Path, dict[str, Any]]:
    """``(served name, onnx file, meta)`` for a run directory or an ``.onnx`` file."""
    if path.is_dir():
        return _from_run_dir(path)
    if path.suffix == ".onnx":
        if not path.is_file():
            raise ModelFileError(f"ONNX file {path} does not exist; check the path")
        return path.stem, path, {"source": str(path)}
    raise ServeError(
        f"{path} is neither a run directory nor an .onnx file; pass runs/<id> or model.onnx"
    )


def _from_run_dir(run_dir: Path) -> tuple[str, Path, dict[str, Any]]:
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.is_file():
        raise ManifestError(
            f"{run_dir} has no manifest.json; pass a run directory written by `slimline optimize`"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        selected = manifest["selected"]
        name = manifest["task"]["name"]
        cand = next(c for c in manifest["candidates"] if c["name"] == selected)
    except (ValueError, KeyError, TypeError, StopIteration):
        raise ManifestError(
            f"{manifest_path} lacks a selected candidate with its task name; rerun "
            "`slimline optimize` or serve the .onnx artifact directly"
        ) from None
    if not cand.get("artifact"):
        raise ServeError(
            f"run {run_dir}: the selected candidate {selected!r} has no ONNX artifact "
            "(a torch model cannot be served); export it to ONNX first"
        )
    onnx_path = run_dir / cand["artifact"]
    if not onnx_path.is_file():
        raise ModelFileError(f"run {run_dir}: artifact {onnx_path} is missing; rerun the pipeline")
    meta = {
        "source": str(run_dir),
        "candidate": selected,
        "run_status": manifest.get("status"),
        "runtime": manifest.get("selected_runtime") or "onnxruntime",
        "output_kind": (manifest.get("task") or {}).get("output_kind"),
    }
    int8 = (manifest.get("hardware") or {}).get("int8") or {}
    if cand.get("step") in INT8_STEPS and int8.get("kind"):
        meta["int8_built_on"] = int8["kind"]
        meta["int8_built_saturating"] = recorded_saturates(int8)
    if (manifest.get("memory_profile") or {}).get("candidate") == selected:
        meta["memory_profile"] = manifest["memory_profile"]
    return str(name), onnx_path, meta


def load_served_models(
    paths: list[Path],
    threads: int = 1,
    *,
    spinning: bool = False,
    runtime: str | None = None,
    memory: Callable[[Path, dict[str, Any]], MemorySetting | None] | None = None,
    instances: int = 1,
) -> list[ServedModel]:
    """Load each path on ``runtime``, or (``None``) on the runtime its run picked (ONNX
    Runtime for a bare ``.onnx`` file); two paths may not share a served name.
    ``memory(onnx_path, meta)`` gives a model's ONNX Runtime memory setting (None: defaults)."""
    models: list[ServedModel] = []
    for path in paths:
        name, onnx_path, meta = resolve_model_path(Path(path))
        if any(m.name == name for m in models):
            raise ServeError(
                f"two models are both named {name!r}; serve them from separate processes or "
                "rename one .onnx file"
            )
        chosen = runtime or meta.get("runtime") or "onnxruntime"
        meta = {**meta, "runtime": chosen}
        meta = with_int8_kind_note(name, meta)
        setting = (
            memory(onnx_path, meta) if memory is not None and chosen == "onnxruntime" else None
        )
        if setting is not None:
            meta["memory_setting"] = setting.model_dump()
        backend = make_backend(
            onnx_path, threads, chosen, spinning=spinning, memory=setting, instances=instances
        )
        frozen = frozen_inputs(onnx_path)
        if frozen:
            meta["constant_inputs"] = {k: v.tolist() for k, v in frozen.items()}
        models.append(ServedModel(name, backend, source=str(path), meta=meta, frozen=frozen))
    return models


def with_int8_kind_note(label: str, meta: dict[str, Any]) -> dict[str, Any]:
    """``meta``, with ``int8_kind_warning`` and the warning logged for ``label`` where
    :func:`int8_kind_differs` gives one."""
    note = int8_kind_differs(meta)
    if note is None:
        return meta
    log.warning("%s: %s", label, note)
    return {**meta, "int8_kind_warning": note}


def int8_kind_differs(meta: dict[str, Any]) -> str | None:
    """Why this run's INT8 model may not keep its measured fidelity here, or None: its run
    judged it on a CPU kind whose INT8 numerics differ from this CPU's (with VNNI or AMX, 8-bit
    products sum in 32 bits; without, in pairs in 16 bits, which can saturate). A kind with the
    same numerics (AMX and AVX512-VNNI, say) changes only the speed."""
    from ..cpu import detect

    built_on = meta.get("int8_built_on")
    cpu = detect()
    if not built_on or bool(meta.get("int8_built_saturating")) == cpu.u8s8_saturates:
        return None
    return (
        f"its INT8 model was built and judged on a {built_on} CPU and this CPU is {cpu.kind}, "
        "whose INT8 kernels sum 8-bit products differently "
        f"({'in 16 bits' if cpu.u8s8_saturates else 'in 32 bits'} here), so its fidelity here "
        "was not measured; run `slimline optimize` on this kind of CPU to build and judge one "
        "for it"
    )


def make_backend(
    path: Path,
    threads: int,
    runtime: str = "onnxruntime",
    *,
    spinning: bool = False,
    memory: MemorySetting | None = None,
    instances: int = 1,
) -> InferenceBackend:
    """The serving backend for ``path`` on ``runtime`` (``onnxruntime`` or ``openvino``);
    ``memory`` is an ONNX Runtime memory setting (the memory profile measures ONNX Runtime).
    ``instances`` batches run at once: an ONNX Runtime session takes concurrent runs as it is,
    an OpenVINO model needs one stream per instance."""
    if runtime == "openvino":
        return OvBackend(path, threads, streams=instances)
    if is_ir(path):
        raise ServeError(
            f"{path.name} is an OpenVINO IR, which runs on OpenVINO only; serve it with "
            "--runtime openvino"
        )
    return OrtBackend(path, threads, spinning=spinning, memory=memory)
