"""Peak RSS of a model, measured in a fresh subprocess that loads it and runs it.

The worker records its RSS after imports (the runtime's own cost), loads the model, runs it on
the given inputs, and reports the process's peak RSS (``VmHWM``). ``peak_rss_mb`` is what the
process peaked at; ``model_rss_mb`` is the part above the post-import baseline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..candidate import Candidate
from ..task import Inputs

__all__ = ["peak_rss"]


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mb() -> float:
    return _status_mb("VmRSS")


def peak_rss(
    cand: Candidate,
    sample: Inputs,
    threads: int,
    task_source: str | None,
    runs: int = 3,
    timeout: float = 600,
    runtime: str = "onnxruntime",
) -> dict[str, float] | None:
    """Peak RSS for an ONNX candidate, or a torch candidate rebuilt from its task's factory.

    Returns ``None`` for a torch module that cannot be rebuilt in a fresh process.

    ``runs``: the peak is reached by the second run on the same input (the first allocates,
    ONNX Runtime's memory pattern plans the second) and stays flat after it: all-MiniLM-L6-v2 at
    batch 32, traced run by run over 20 runs on ONNX Runtime, OpenVINO and torch (FP32 and
    NNCF INT8), changed by at most 0.1 MB after run 2. Three runs keep a margin of one (each
    is a batch-32 call: over a second for a 40 ms model on an AVX2-only CPU).
    """
    if cand.onnx is not None:
        target = ["--onnx", str(cand.onnx), "--runtime", runtime]
    elif cand.step == "fp32" and task_source is not None:
        target = ["--task", task_source]
    else:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        npz = Path(tmp) / "inputs.npz"
        np.savez(npz, **sample)  # type: ignore[arg-type]
        cmd = [
            sys.executable,
            "-m",
            "slimline.measure.memory",
            *target,
            "--inputs",
            str(npz),
            "--threads",
            str(threads),
            "--runs",
            str(runs),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"peak-RSS worker failed for {cand.name}: {proc.stderr.strip()[-500:]}")
    peak: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return peak


def _worker(argv: list[str]) -> dict[str, Any]:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--onnx")
    p.add_argument("--task")
    p.add_argument("--inputs", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--runtime", default="onnxruntime")
    a = p.parse_args(argv)
    with np.load(a.inputs) as z:
        inputs = {k: z[k] for k in z.files}
    from .runners import OrtRunner, TorchRunner  # the runtime's import cost is the baseline

    if a.runtime == "openvino":
        from .ov import OvRunner, require_openvino

        require_openvino()

    if a.task:
        import torch  # noqa: F401
    base = _rss_mb()
    if a.onnx and a.runtime == "openvino":
        runner: Any = OvRunner("m", Path(a.onnx), a.threads)
    elif a.onnx:
        runner = OrtRunner("m", Path(a.onnx), a.threads)
    else:
        from ..task import load_task

        task = load_task(a.task)
        assert task.model is not None
        runner = TorchRunner("m", task.model(), a.threads)
    for _ in range(a.runs):
        runner.run(inputs)
    # VmHWM belongs to this address space; ru_maxrss would carry the forking parent's peak
    # across exec and report the parent's size instead of ours.
    peak = _status_mb("VmHWM")
    return {
        "peak_rss_mb": round(peak, 1),
        "baseline_rss_mb": round(base, 1),
        "model_rss_mb": round(peak - base, 1),
        "runs": a.runs,
    }


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1:])))
