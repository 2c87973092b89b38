"""One small interface per runtime: ``Runner.run(inputs) -> first output as np.ndarray``.

ONNX Runtime sessions are pinned to the target's thread count (intra-op = threads, inter-op = 1,
sequential execution); torch runs with ``threads`` torch threads in inference mode, and puts the
process's thread count back after each call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..candidate import Candidate
from ..errors import InputMismatchError, ModelFileError
from ..module_guard import eval_module, torch_threads
from ..task import Inputs, check_inputs

__all__ = [
    "ORT_TO_NP",
    "OrtRunner",
    "Runner",
    "TorchRunner",
    "make_runner",
    "ort_session",
    "session_input_spec",
]


class Runner(Protocol):
    name: str

    def run(self, inputs: Inputs) -> np.ndarray: ...


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
) -> Any:
    import onnxruntime as ort

    if not Path(path).is_file():
        raise ModelFileError(f"ONNX file {path} does not exist; check the path")
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
        first = str(err).strip().splitlines()[0][:200]
        raise ModelFileError(
            f"ONNX Runtime cannot load {path} ({first}); the file is corrupt or not an ONNX model: "
            "re-export it"
        ) from None


def session_input_spec(sess: Any) -> dict[str, tuple[str, list[Any]]]:
    return {
        i.name: (
            ORT_TO_NP.get(i.type, i.type),
            [d if isinstance(d, int) else None for d in i.shape],
        )
        for i in sess.get_inputs()
    }


class OrtRunner:
    def __init__(self, name: str, path: Path, threads: int) -> None:
        self.name = name
        self.session = ort_session(path, threads)
        self.spec = session_input_spec(self.session)
        self._checked = False

    def run(self, inputs: Inputs) -> np.ndarray:
        if not self._checked:
            check_inputs(inputs, self.spec, f"model {self.name}")
            self._checked = True
        return self.session.run(None, inputs)[0]


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
        return out.detach().float().numpy()


def make_runner(cand: Candidate, threads: int) -> Runner:
    if cand.onnx is not None:
        return OrtRunner(cand.name, cand.onnx, threads)
    if cand.module is not None:
        return TorchRunner(cand.name, cand.module, threads)
    raise ValueError(f"candidate {cand.name} has nothing to run")
