"""A metric hook that raises on a candidate rejects that step with the hook's error, and the run
completes: ``slimline optimize`` on an ONNX CNN whose hook refuses any output that is not
FP32's own (an INT8 model's outputs differ from FP32's on every CPU kind; by how much does not
matter here)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import yaml
from quant_fixtures import cnn_inputs

from slimline.cli import main

HOOK = """
import numpy as np

def exact(outputs, labels):
    (out,) = outputs.values()
    if not np.array_equal(out, labels):
        raise ValueError("outputs differ from FP32's")
    return 1.0
"""


def test_a_hook_failing_on_the_int8_candidate_rejects_it_and_the_run_completes(
    cnn_onnx: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLIMLINE_CACHE", str(cache))
    (tmp_path / "hook.py").write_text(HOOK)
    np.savez(tmp_path / "calib.npz", **cnn_inputs(1, 32))  # type: ignore[arg-type]
    evaluation = cnn_inputs(2, 8)
    sess = ort.InferenceSession(str(cnn_onnx), providers=["CPUExecutionProvider"])
    fp32 = sess.run(None, evaluation)[0]
    np.savez(tmp_path / "eval.npz", **evaluation, labels=fp32)  # type: ignore[arg-type]
    recipe = {
        "name": "hook",
        "task": str(cnn_onnx),
        "samples": "calib.npz",
        "eval_samples": "eval.npz",
        "metric": "hook.py:exact",
        "target": {"threads": 1},
        "bench": {
            "rounds": 4,
            "runs_per_round": 50,
            "batch_sizes": [1],
            "throughput_min_seconds": 0.02,
            "warmup": 2,
            "peak_rss": False,
        },
        "steps": [{"quantize": {"samples": 16, "mixed_precision": False}}],
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    out = tmp_path / "run"
    assert main(["optimize", str(tmp_path / "r.yaml"), "--out", str(out)]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "complete" and m["selected"] == "fp32-onnx"
    q = next(c for c in m["candidates"] if c["name"] == "quantize")
    assert not q["accepted"]
    assert q["reason"] == "metric hook exact failed: ValueError: outputs differ from FP32's"
