"""One ONNX Runtime setting that decides a session's memory: the CPU arena, memory patterns, the
execution mode, the intra-op thread count, the graph optimization level (``all`` adds layout
transformations that keep reordered copies of the weights) and, for inputs whose shapes vary,
arena shrinkage after each run. A leaf module: the server and the memory profile both build sessions from it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..config import Config

__all__ = ["MemorySetting"]

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
