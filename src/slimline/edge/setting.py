"""One ONNX Runtime setting that decides a session's memory: the CPU arena, memory patterns, the
execution mode, the intra-op thread count, the graph optimization level (``all`` adds layout
transformations that keep reordered copies of the weights), where the weights live (inside the
.onnx file, which ONNX Runtime reads into memory and then copies into its tensors, or in an
external-data file it memory-maps) and, for inputs whose shapes vary, arena shrinkage after each
run. A leaf module: the server and the memory profile both build sessions from it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from ..config import Config
from ..paths import cache_dir

__all__ = ["MemorySetting", "session_path"]

# ONNX Runtime's run option that returns the arena's unused chunks to the system after a run
SHRINKAGE_KEY = "memory.enable_memory_arena_shrinkage"


class MemorySetting(Config):
    """The session options that decide memory. The defaults are ONNX Runtime's own (arena on,
    memory patterns on, sequential execution), which is what slimline serves without a budget."""

    arena: bool = True
    mem_pattern: bool = True
    execution_mode: Literal["sequential", "parallel"] = "sequential"
    threads: int = Field(1, ge=1, le=256)
    arena_shrinkage: bool = False
    graph_level: Literal["all", "basic"] = "all"
    # weights in an external-data file that ONNX Runtime memory-maps: loading then holds one
    # copy of them (file-backed pages) instead of the parsed file plus the tensors built from it
    mmap_weights: bool = False

    @property
    def label(self) -> str:
        parts = [
            f"arena {'on' if self.arena else 'off'}",
            f"patterns {'on' if self.mem_pattern else 'off'}",
            self.execution_mode,
            f"{self.threads} thread{'s' if self.threads > 1 else ''}",
        ]
        if self.arena_shrinkage:
            parts.append("shrink arena")
        if self.graph_level != "all":
            parts.append(f"{self.graph_level} graph optimization")
        if self.mmap_weights:
            parts.append("weights memory-mapped")
        return ", ".join(parts)

    def apply(self, so: Any) -> None:
        """Set these options on an ``onnxruntime.SessionOptions``."""
        import onnxruntime as ort

        so.graph_optimization_level = {
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        }[self.graph_level]
        so.enable_cpu_mem_arena = self.arena
        so.enable_mem_pattern = self.mem_pattern
        so.intra_op_num_threads = self.threads
        if self.execution_mode == "parallel":
            so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
            so.inter_op_num_threads = self.threads
        else:
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            so.inter_op_num_threads = 1

    def run_options(self) -> Any:
        """The ``onnxruntime.RunOptions`` of every call (``None`` when ONNX Runtime's defaults)."""
        if not (self.arena and self.arena_shrinkage):
            return None
        import onnxruntime as ort

        ro = ort.RunOptions()
        ro.add_run_config_entry(SHRINKAGE_KEY, "cpu:0")
        return ro


def session_path(model: Path, setting: MemorySetting | None) -> Path:
    """The file a session under ``setting`` loads: ``model`` itself, or (``mmap_weights``) a copy
    whose weights are in an external-data file, written once per source file into the cache
    (``$SLIMLINE_CACHE/mmap``) by a child process, so the conversion's own memory never counts
    against the process that serves or measures."""
    if setting is None or not setting.mmap_weights:
        return model
    st = model.stat()
    stamp = f"{model.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:24]
    out = cache_dir("mmap") / key
    target = out / "model.onnx"
    if target.is_file() and (out / "model.onnx.data").is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=out.parent))
    cmd = [sys.executable, "-m", "slimline.edge.setting", str(model), str(tmp / "model.onnx")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"could not write {model} with external weights: {last[:300]}")
    try:
        os.rename(tmp, out)  # atomic publish; a concurrent writer's copy is as good
    except OSError:
        if not target.is_file():
            raise
    return target


def _write_external(source: str, target: str) -> None:
    import onnx

    model = onnx.load(source)
    onnx.save_model(
        model,
        target,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=1024,
    )


if __name__ == "__main__":
    _write_external(sys.argv[1], sys.argv[2])
