"""One small interface per runtime: ``Runner.run(inputs)`` -> the primary output (the first,
unless the task's signature names another), ``Runner.run_all(inputs)`` -> every output by name.

A runner given a :class:`~slimline.signature.Signature` forms the model's batches itself: a model
that takes one row per call gets the rows in turn, and their outputs are joined along each
output's batch axis.

ONNX Runtime sessions are pinned to the target's thread count (intra-op = threads, inter-op = 1,
sequential execution); torch runs with ``threads`` torch threads in inference mode, and puts the
process's thread count back after each call.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..candidate import Candidate, is_ir
from ..errors import CandidateError, InputMismatchError, ModelFileError, SlimlineError
from ..module_guard import eval_module, torch_threads
from ..signature import ModelInput, Signature
from ..tensors import FROZEN_KEY, Inputs, frozen_from_json
from .ov import OvRunner
from .rowwise import RowwiseRunner

__all__ = [
    "ORT_TO_NP",
    "OrtRunner",
    "Runner",
    "TorchRunner",
    "check_candidate",
    "failing_node",
    "make_runner",
    "ort_message",
    "ort_session",
    "runs_to_fill",
    "session_frozen",
    "session_input_spec",
]


class Runner(Protocol):
    name: str

    def run(self, inputs: Inputs) -> np.ndarray: ...

    def run_all(self, inputs: Inputs) -> dict[str, np.ndarray]: ...


ORT_TO_NP = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int16)": "int16",
    "tensor(int8)": "int8",
    "tensor(uint64)": "uint64",
    "tensor(uint32)": "uint32",
    "tensor(uint16)": "uint16",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}


def ort_session(
    path: Path,
    threads: int,
    *,
    profile: Path | None = None,
    optimized_out: Path | None = None,
    level: str = "all",
    user_model: bool = False,
) -> Any:
    """An ONNX Runtime session for ``path``, pinned to ``threads``.

    A load failure blames the file's author: with ``user_model`` the user's own model
    (:class:`ModelFileError`, exit 2); otherwise a candidate slimline wrote
    (:class:`CandidateError`: that candidate is rejected, the run goes on)."""
    import onnxruntime as ort

    if not Path(path).is_file():
        raise _load_error(path, "the file does not exist", user_model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    so.log_severity_level = 3
    if profile is not None:  # trace file prefix for ONNX Runtime's profiler
        so.enable_profiling = True
        so.profile_file_prefix = str(profile)
    if optimized_out is not None:
        so.optimized_model_filepath = str(optimized_out)
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as err:  # ORT raises its own Fail/InvalidGraph/... types
        raise _load_error(path, ort_message(err), user_model) from None


def _load_error(path: Path, why: str, user_model: bool) -> SlimlineError:
    if user_model:
        if why == "the file does not exist":
            return ModelFileError(f"ONNX file {path} does not exist; check the path")
        import onnxruntime as ort

        return ModelFileError(
            f"ONNX Runtime {ort.__version__} cannot load the model {path} ({why}): it is corrupt "
            "or not an ONNX model this ONNX Runtime can run; re-export it"
        )
    return CandidateError(
        f"ONNX Runtime cannot load {Path(path).name}, a candidate slimline wrote: {why}"
    )


_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*")
_NODE = re.compile(r'In Node, \("([^"]*)", (\w+)|Name: (\S+) OpType: (\w+)')


def failing_node(message: str) -> str | None:
    """The node (``name (OpType)``) an ONNX Runtime or onnx.checker message names, if any."""
    m = _NODE.search(message)
    if m is None:
        return None
    name, op = (m.group(1), m.group(2)) if m.group(2) else (m.group(3), m.group(4))
    return f"{name} ({op})"


def ort_message(err: BaseException) -> str:
    """ONNX Runtime's error on one line: the status and the cause, with the failing node; the
    node's full input/output signature, which can run to kilobytes, is left out."""
    text = " ".join(str(err).split()) or type(err).__name__
    text = _ORT_PREFIX.sub("", text)
    node = failing_node(text)
    if node is not None and ", Error " in text:
        status = text.split(" : ", 1)[0] if " : " in text[:40] else ""
        cause = text.rsplit(", Error ", 1)[1]
        text = f"{status + ': ' if status else ''}{cause} (node {node})"
    return text if len(text) <= 400 else text[:397] + "..."


# ONNX Runtime registers some ops in the default domain before ONNX's own opset adds them
# (LayerNormalization, which its graph optimizer writes into an opset 11/12 graph): the checker,
# which knows ONNX's schemas only, refuses a graph the runtime that runs it loads and runs.
_RUNTIME_SCHEMA = re.compile(r"No Op registered for \w+ with domain_version of \d+")


def _ort_loads(path: Path, threads: int) -> bool:
    try:
        ort_session(path, threads)
    except Exception:
        return False
    return True


def check_candidate(path: Path, threads: int = 1) -> None:
    """Check a model slimline wrote before anything evaluates it: ``onnx.checker`` on the path
    (so models over 2 GB with external data are checked too), then an ONNX Runtime load.
    Raises :class:`CandidateError` with the checker's or the runtime's message and the node."""
    import onnx

    if is_ir(path):  # OpenVINO IR: checked by OpenVINO reading it (it runs on OpenVINO only)
        from .ov import ov_message, require_openvino

        try:
            require_openvino().Core().read_model(str(path))
        except Exception as err:
            raise CandidateError(
                f"OpenVINO cannot read {Path(path).name}, a candidate slimline wrote: "
                f"{ov_message(err)}"
            ) from None
        return
    try:
        onnx.checker.check_model(str(path))
    except Exception as err:  # ValidationError, or a protobuf/IO error on a broken file
        text = " ".join(str(err).split()) or type(err).__name__
        if _RUNTIME_SCHEMA.search(text) and _ort_loads(path, threads):
            return
        node = failing_node(text)
        cause = text.split(" ==> Context:", 1)[0]
        if len(cause) > 300:
            cause = cause[:297] + "..."
        raise CandidateError(
            f"onnx.checker rejects {Path(path).name}, a candidate slimline wrote: {cause}"
            + (f" (node {node})" if node else "")
        ) from None
    ort_session(path, threads)


def session_input_spec(sess: Any) -> dict[str, tuple[str, list[Any]]]:
    return {
        i.name: (
            ORT_TO_NP.get(i.type, i.type),
            [d if isinstance(d, int) else None for d in i.shape],
        )
        for i in sess.get_inputs()
    }


def session_frozen(sess: Any) -> dict[str, np.ndarray]:
    """The inputs a session's model was frozen for (its metadata, :data:`FROZEN_KEY`)."""
    return frozen_from_json(sess.get_modelmeta().custom_metadata_map.get(FROZEN_KEY))


class OrtRunner(RowwiseRunner):
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
        self.session = ort_session(path, threads, user_model=user_model)
        self.spec = session_input_spec(self.session)
        self.frozen = session_frozen(self.session)
        self.signature = signature
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._checked = False

    @property
    def model_inputs(self) -> dict[str, Any]:
        """Input name -> dtype and dims as the model declares them (named free dims kept)."""
        return {
            i.name: ModelInput(ORT_TO_NP.get(i.type, i.type), list(i.shape))
            for i in self.session.get_inputs()
        }

    @property
    def output_dims(self) -> dict[str, list[Any]]:
        return {o.name: list(o.shape) for o in self.session.get_outputs()}

    def call(self, inputs: Inputs) -> dict[str, np.ndarray]:
        """One session call, no batching (on inputs :meth:`fit` to the model)."""
        return dict(zip(self.output_names, self.session.run(None, inputs), strict=True))


class TorchRunner:
    """Runs ``module`` in eval mode with ``threads`` torch threads, changing neither: a module
    in training mode is run as an eval-mode copy, and the thread count is set per call and put
    back (a no-op when it already is ``threads``, as inside :func:`~.latency.benchmark`)."""

    def __init__(self, name: str, module: Any, threads: int) -> None:
        self.name = name
        self.module = eval_module(module)
        self.threads = threads

    def run(self, inputs: Inputs) -> np.ndarray:
        import torch

        with torch.inference_mode(), torch_threads(self.threads):
            try:
                out = self.module(
                    **{k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}
                )
            except TypeError as err:
                raise InputMismatchError(
                    f"model {self.name} does not accept inputs {sorted(inputs)} ({err}); name the "
                    "input arrays after the model's forward() arguments"
                ) from None
        if isinstance(out, (tuple, list)):
            out = out[0]
        result: np.ndarray = out.detach().float().numpy()
        return result

    def run_all(self, inputs: Inputs) -> dict[str, np.ndarray]:
        return {"output": self.run(inputs)}


def make_runner(
    cand: Candidate,
    threads: int,
    signature: Signature | None = None,
    runtime: str = "onnxruntime",
) -> Runner:
    """A runner for ``cand``: its ONNX file on ``runtime`` (``onnxruntime`` or ``openvino``),
    else its torch module."""
    if cand.onnx is not None and runtime == "openvino":
        return OvRunner(cand.name, cand.onnx, threads, signature)
    if is_ir(cand.onnx):
        raise CandidateError(
            f"{cand.name} is an OpenVINO IR ({Path(str(cand.onnx)).name}): it runs on OpenVINO "
            "only, not on ONNX Runtime"
        )
    if cand.onnx is not None:
        return OrtRunner(cand.name, cand.onnx, threads, signature)
    if cand.module is not None:
        return TorchRunner(cand.name, cand.module, threads)
    raise ValueError(f"candidate {cand.name} has nothing to run")


def runs_to_fill(per_run_s: float, seconds: float, floor: int, most: int) -> int:
    """How many runs of ``per_run_s`` seconds fill ``seconds``: at most ``most``, not under
    ``floor`` (``most`` when the run time is unknown, 0 or less)."""
    if per_run_s <= 0.0:
        return most
    return min(most, max(floor, int(seconds / per_run_s)))
