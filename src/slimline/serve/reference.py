"""The run's evaluation outputs, saved for the drift monitor: ``RUN_DIR/monitor_reference.npz``.

:func:`write_monitor_reference` loads the run's task (as its manifest names it), runs the
selected artifact on up to ``limit`` rows of the task's evaluation inputs and saves every output
(and, when the task declared its output kind ``logits``, the ``__logits__`` marker). ``slimline
publish`` calls it, so each repository version carries the reference its server compares live
predictions with; ``slimline serve RUN_DIR`` uses the file when it is there.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from ..candidate import is_ir
from ..errors import ManifestError
from ..tensors import take_samples
from .model import OrtBackend, make_backend, resolve_model_path
from .monitor import LOGITS_KEY, REFERENCE_FILE

__all__ = ["write_monitor_reference"]


def write_monitor_reference(run_dir: Path, limit: int = 1000, chunk: int = 64) -> Path:
    """Evaluate the run's selected artifact on its task's evaluation inputs; save the outputs."""
    from ..task import load_task

    manifest = json.loads((run_dir / "manifest.json").read_text())
    task_doc = manifest.get("task") or {}
    recipe = manifest.get("recipe") or {}
    source = task_doc.get("source") or recipe.get("task")
    if not source:
        raise ManifestError(f"{run_dir}/manifest.json names no task; the reference needs its data")
    task = load_task(str(source), recipe.get("samples"), recipe.get("eval_samples"))
    inputs = take_samples((batch for batch, _ in task.eval_data()), limit, task.signature)
    _, onnx_path, _ = resolve_model_path(run_dir)
    backend = make_backend(onnx_path, 1, "openvino") if is_ir(onnx_path) else OrtBackend(onnx_path)
    rows = len(next(iter(inputs.values())))
    parts = [backend.run({k: v[s : s + chunk] for k, v in inputs.items()})
             for s in range(0, rows, chunk)]  # fmt: skip
    arrays = {o.name: np.concatenate([p[o.name] for p in parts]) for o in backend.outputs}
    if task_doc.get("output_kind") == "logits":
        arrays[LOGITS_KEY] = np.array([backend.outputs[0].name])
    return _save_atomically(run_dir / REFERENCE_FILE, arrays)


def _save_atomically(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.partial")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
