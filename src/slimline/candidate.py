"""A candidate: one version of the model on its way through the steps, with its lineage."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["QUANTIZABLE_SOURCE", "Candidate", "module_hash", "quantizable_graph"]

# meta key: the file, beside the candidate's ONNX, of an equivalent float graph offline tools can
# read, set by a step whose saved graph holds runtime-only fusions (FusedConv, FusedMatMul)
QUANTIZABLE_SOURCE = "quantizable_source"


@dataclass
class Candidate:
    """A model version. ``onnx`` is the artifact measured on the target runtime; ``module`` is
    the torch model it came from, where one exists (FP32 reference, pruned model before export).
    ``meta`` is the step's record of what it applied (precision map, op counts, plan, ...);
    it must stay JSON-serialisable because it goes into the manifest."""

    name: str
    step: str
    parent: str | None
    onnx: Path | None = None
    module: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    accepted: bool | None = None
    reason: str = ""
    measurement: dict[str, Any] | None = None  # filled where a step measured it itself

    @property
    def runtime(self) -> str:
        return "onnxruntime" if self.onnx is not None else "torch"

    def content_hash(self) -> str:
        if self.onnx is not None:
            return file_hash(self.onnx)
        if self.module is not None:
            return module_hash(self.module)
        raise ValueError(f"candidate {self.name} has neither an ONNX file nor a module")


def quantizable_graph(cand: Candidate) -> Path:
    """The float graph that quantization and other offline ONNX tools can read for ``cand``:
    its ONNX file, or the source its step named where that file holds runtime-only fusions."""
    if cand.onnx is None:
        raise ValueError(f"candidate {cand.name} has no ONNX graph")
    source = cand.meta.get(QUANTIZABLE_SOURCE)
    return Path(cand.onnx).parent / source if source else Path(cand.onnx)


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def module_hash(module: Any) -> str:
    """Hash of a torch module's architecture and weights (state_dict order, names, bytes)."""
    h = hashlib.sha256(repr(module).encode())
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(
            t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes() if t.numel() else b""
        )
    return "sha256:" + h.hexdigest()
