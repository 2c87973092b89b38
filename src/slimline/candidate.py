"""A candidate: one version of the model on its way through the steps, with its lineage."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "QUANTIZABLE_SOURCE",
    "Candidate",
    "artifact_files",
    "artifact_size",
    "is_ir",
    "module_hash",
    "quantizable_graph",
]

# OpenVINO IR: the ``.xml`` graph a candidate's ``onnx`` names, its weights in the ``.bin`` beside it
IR_SUFFIX, IR_WEIGHTS = ".xml", ".bin"

# meta key: the file, beside the candidate's ONNX, of an equivalent float graph offline tools can
# read, set by a step whose saved graph holds runtime-only fusions (FusedConv, FusedMatMul)
QUANTIZABLE_SOURCE = "quantizable_source"


@dataclass
class Candidate:
    """A model version. ``onnx`` is the artifact measured on the target runtime; ``module`` is
    the torch model it came from, where one exists (FP32 reference, pruned model before export).
    ``onnx`` may also name an OpenVINO IR (``.xml``, weights in the ``.bin`` beside it), which
    runs on OpenVINO only (:func:`is_ir`).
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
            return artifact_hash(Path(self.onnx))
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


def is_ir(path: Path | str | None) -> bool:
    """Whether ``path`` is an OpenVINO IR graph (``.xml``): an artifact only OpenVINO runs."""
    return path is not None and Path(path).suffix == IR_SUFFIX


def artifact_files(path: Path) -> list[Path]:
    """The files of an artifact: the ONNX file, or an IR's ``.xml`` and its ``.bin``."""
    path = Path(path)
    return [path, path.with_suffix(IR_WEIGHTS)] if is_ir(path) else [path]


def artifact_size(path: Path) -> int:
    """Bytes on disk of an artifact's files (an IR's weights included)."""
    return sum(f.stat().st_size for f in artifact_files(path) if f.is_file())


def artifact_hash(path: Path) -> str:
    """The content hash of an artifact: its file's, or for an IR the hash over both files."""
    if not is_ir(path):
        return file_hash(path)
    h = hashlib.sha256()
    for f in artifact_files(path):
        h.update(file_hash(f).encode())
    return "sha256:" + h.hexdigest()


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
