"""``quantize_ops: compute``: fake quantization (QAT) and Q/DQ (PTQ) around the compute layers
only; the element-wise ops between them stay float."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from slimline.compress.qat import fakequant as fq
from slimline.compress.quant.config import QuantizeConfig, QuantSpec
from slimline.compress.quant.fallback import kernel_report
from slimline.cpu import detect
from slimline.export import export_module

from .test_qat import _batches, _tiny

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane


def _quantized_op_outputs(path: Path) -> set[str]:
    """Op types whose output a QuantizeLinear reads."""
    graph = onnx.load(str(path)).graph
    producer = {o: n for n in graph.node for o in n.output}
    return {
        producer[n.input[0]].op_type
        for n in graph.node
        if n.op_type == "QuantizeLinear" and n.input[0] in producer
    }


def _export(ops: str, tmp: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    fmt = fq.format_for(detect(), ops=ops)  # type: ignore[arg-type]  # the CPU's own weights
    model = fq.prepare(_tiny(), {"x": torch.from_numpy(_batches()[0]["x"])}, fmt)
    fq.calibrate(model, _batches(), 32)
    exported = fq.export_module_for(model.eval())
    x = _batches(1, 16)[0]
    with torch.no_grad():
        want = model(torch.from_numpy(x["x"])).numpy()
    path = export_module(exported, x, tmp / f"q-{ops}.onnx")
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, x)[0]
    return path, want, got


def test_compute_ops_qat_leaves_the_residual_add_float(tmp_path: Path) -> None:
    every, _, _ = _export("all", tmp_path)
    assert "Add" in _quantized_op_outputs(every)
    path, want, got = _export("compute", tmp_path)
    assert "Add" not in _quantized_op_outputs(path)
    assert "Conv" in _quantized_op_outputs(path)
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.mean() >= 0.999
    report = kernel_report(path)
    assert report["int8_kernels"] == report["compute_kernels"] == 4, report
    assert fq.FakeQuantFormat(ops="compute").label.endswith("compute-ops")


def test_compute_ops_ptq_spec_follows_the_config() -> None:
    cfg = QuantizeConfig(mode="static", quantize_ops="compute")
    spec = QuantSpec.from_config(cfg)
    assert spec.ops == "compute" and "compute-ops" in spec.label
    assert QuantSpec.from_config(QuantizeConfig(mode="static")).ops == "all"
