"""Per-operator time on OpenVINO from its performance counters (``PERF_COUNT``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..tensors import Inputs, drop_frozen, frozen_inputs
from .opprofile import aggregate, profile_runs
from .ov import ov_compile, ov_version

__all__ = ["ov_profile_ops"]


def ov_profile_ops(
    path: Path, inputs: Inputs, threads: int, runs: int = 50, top: int = 15, warmup: int = 5
) -> dict[str, Any]:
    """The same result shape as :func:`~slimline.measure.opprofile.profile_ops` (ONNX
    Runtime's), so a reader sees where each runtime spends its time. Node names and types are
    the ones OpenVINO executes after its own fusions; ``exec_types`` names the kernels (e.g.
    ``brgconv_avx512_amx_I8`` or ``jit_avx512_I8``), which tells INT8 kernels from float ones."""
    compiled = ov_compile(path, threads, profile=True)
    request = compiled.create_infer_request()
    takes = {n for p in compiled.inputs for n in p.get_names()}
    inputs = drop_frozen(inputs, takes, frozen_inputs(path), Path(path).name)
    feed = {k: np.ascontiguousarray(v) for k, v in inputs.items()}
    runs = profile_runs(lambda: request.infer(feed), warmup, runs)
    kernels: list[dict[str, Any]] = []
    exec_types: dict[str, int] = {}
    for _ in range(runs):
        request.infer(feed)
        for info in request.get_profiling_info():
            if str(info.status).endswith("EXECUTED") and "NOT_RUN" not in str(info.status):
                kernels.append(
                    {
                        "node": info.node_name,
                        "op_type": info.node_type,
                        "dur": info.real_time.total_seconds() * 1e6,
                    }
                )
                exec_types[info.exec_type] = exec_types.get(info.exec_type, 0) + 1
    result = aggregate(kernels, runs, top)
    result["threads"] = threads
    result["runtime"] = f"openvino {ov_version()}"
    result["exec_types"] = dict(sorted(exec_types.items(), key=lambda kv: -kv[1]))
    return result
