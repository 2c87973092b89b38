"""A QAT model whose QDQ export fails: the step is rejected, the run completes from the earlier
steps' artifacts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from slimline.compress.qat import fakequant as fq
from slimline.pipeline import run_recipe
from slimline.recipe import recipe_from_dict

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane


class _Unexportable(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.cummax(self.inner(x), 1)[0]  # no ONNX form in opset 17
        return out


def test_a_failed_qat_export_rejects_the_step_and_the_run_completes(
    tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = fq.export_module_for

    def broken(model: Any) -> Any:
        return _Unexportable(real(model))

    monkeypatch.setattr(fq, "export_module_for", broken)
    tiny_recipe["steps"] = [
        "export",
        {
            "qat": {
                "finetune": {"steps": 2, "eval_every": 2, "progress": False},
                "compare_ptq": False,
            }
        },
    ]
    out = tmp_path / "run"
    run_recipe(recipe_from_dict(tiny_recipe), out, cache=cache)
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "complete"
    by_name = {c["name"]: c for c in m["candidates"]}
    qat = by_name["qat"]
    assert qat["accepted"] is False and qat["meta"]["failure"]["type"] == "ExportError"
    assert "QDQ export of the fake-quant model failed" in qat["reason"]
    assert "aten::cummax" in qat["reason"]
    assert by_name["fp32-onnx"]["accepted"] and by_name["fp32-onnx"]["artifact"]
    assert any("step qat rejected" in w for w in m["warnings"])
