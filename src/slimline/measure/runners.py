"""One small interface per runtime: ``Runner.run(inputs)`` -> the primary output (the first,
unless the task's signature names another), ``Runner.run_all(inputs)`` -> every output by name.

A runner given a :class:`~slimline.signature.Signature` forms the model's batches itself: a model
that takes one row per call gets the rows in turn, and their outputs are joined along each
output's batch axis.

ONNX Runtime sessions are pinned to the target's thread count (intra-op = threads, inter-op = 1,
sequential execution); torch runs with ``torch.set_num_threads(threads)`` in inference mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..candidate import Candidate
from ..errors import InputMismatchError, ModelFileError
from ..signature import ModelInput, Signature, concat_outputs, n_rows, split_rows
from ..tensors import Inputs, check_inputs

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
    def __init__(
        self, name: str, path: Path, threads: int, signature: Signature | None = None
    ) -> None:
        self.name = name
        self.session = ort_session(path, threads)
        self.spec = session_input_spec(self.session)
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
        """One session call, no batching."""
        return dict(zip(self.output_names, self.session.run(None, inputs), strict=True))

    def _check(self, inputs: Inputs) -> None:
        if not self._checked:
            check_inputs(inputs, self.spec, f"model {self.name}", self.signature)
            self._checked = True

    def _row_by_row(self, inputs: Inputs) -> bool:
        sig = self.signature
        return sig is not None and sig.max_batch == 1 and n_rows(inputs, sig) > 1

    def run_all(self, inputs: Inputs) -> dict[str, np.ndarray]:
        self._check(inputs)
        if self._row_by_row(inputs):
            parts = [self.call(row) for row in split_rows(inputs, 1, self.signature)]
            return concat_outputs(parts, self.signature, stack_unbatched=False)
        return self.call(inputs)

    def run(self, inputs: Inputs) -> np.ndarray:
        self._check(inputs)
        primary = (self.signature.primary_output if self.signature else None) or self.output_names[
            0
        ]
        if self._row_by_row(inputs):
            return self.run_all(inputs)[primary]
        # every output is computed, as a served model computes them all
        return self.session.run(None, inputs)[self.output_names.index(primary)]


class TorchRunner:
    def __init__(self, name: str, module: Any, threads: int) -> None:
        import torch

        self.name = name
        self.module = module.eval()
        self.threads = threads
        torch.set_num_threads(threads)

    def run(self, inputs: Inputs) -> np.ndarray:
        import torch

        with torch.inference_mode():
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

    def run_all(self, inputs: Inputs) -> dict[str, np.ndarray]:
        return {"output": self.run(inputs)}


def make_runner(cand: Candidate, threads: int, signature: Signature | None = None) -> Runner:
    if cand.onnx is not None:
        return OrtRunner(cand.name, cand.onnx, threads, signature)
    if cand.module is not None:
        return TorchRunner(cand.name, cand.module, threads)
    raise ValueError(f"candidate {cand.name} has nothing to run")
