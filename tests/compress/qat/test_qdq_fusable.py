"""The QAT export rewritten so that ONNX Runtime fuses its element-wise ops into integer kernels
(scalar Q/DQ parameters, scalar operands dequantized), computing the same outputs."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from slimline.compress.qat import fakequant as fq
from slimline.compress.qat.qdq import fold_constant_quantizers
from slimline.compress.qat.qdq_fusable import make_file_fusable
from slimline.export import export_module

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane


class _HardSwishAffine(nn.Module):
    """Conv, a learnable-affine block (x * a + b), hard-swish written with scalars, a residual
    Add and Mul of two tensors: PP-OCR's element-wise chains in small."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.add(torch.mul(self.conv(x), 1.2), -0.1)
        gate = torch.clamp(torch.add(y, 3.0), 0.0, 6.0)
        z = torch.mul(y, gate)
        out: torch.Tensor = torch.add(self.conv2(z), z)
        return out


def _optimized_ops(path: Path, tmp: Path) -> collections.Counter[str]:
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp / "opt.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(tmp / "opt.onnx")).graph.node)


def test_element_wise_ops_of_the_export_run_as_integer_kernels(tmp_path: Path) -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(8, 1, 8, 8)).astype(np.float32)} for _ in range(4)]
    model = fq.prepare(
        _HardSwishAffine().eval(), {"x": torch.zeros(2, 1, 8, 8)}, fq.FakeQuantFormat()
    )
    fq.calibrate(model, batches, 32)
    exported = fq.export_module_for(model.eval())
    path = export_module(exported, batches[0], tmp_path / "q.onnx")
    fold_constant_quantizers(path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    before = sess.run(None, batches[1])[0]
    unfused = _optimized_ops(path, tmp_path)
    assert unfused["Add"] + unfused["Mul"] > 0  # as exported, some run in float

    counts = make_file_fusable(path)
    assert counts["scalar_qdq_parameters"] > 0 and counts["quantized_scalar_operands"] == 3
    graph = onnx.load(str(path)).graph
    used = {i for n in graph.node for i in n.input}
    assert all(init.name in used for init in graph.initializer)  # replaced ones are dropped
    fused = _optimized_ops(path, tmp_path)
    assert fused["Add"] == fused["Mul"] == 0, fused
    assert fused["QLinearAdd"] == 3 and fused["QLinearMul"] == 2, fused
    after = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, batches[1]
    )[0]
    a, b = before.reshape(len(before), -1), after.reshape(len(after), -1)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.mean() >= 0.999  # integer kernels round like the float Q/DQ up to a step
