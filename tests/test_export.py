"""Export names every output, makes every batch axis dynamic and checks every output within the
tolerance of the model's kind (float or fake-quant QDQ); the config can override it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from slimline.errors import ExportError
from slimline.export import (
    TOLERANCES,
    ExportConfig,
    export_kind,
    export_module,
    output_names,
    verify_export,
)
from slimline.measure.runners import ort_session


class TwoHeads(torch.nn.Module):
    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = (
            torch.nn.Linear(6, 8),
            torch.nn.Linear(8, 3),
            torch.nn.Linear(8, 2),
        )
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.relu(self.body(x))
        return {"logits": self.a(h), "score": self.b(h)} if self.as_dict else (self.a(h), self.b(h))


class FakeQuant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.fake_quantize_per_tensor_affine(x, 0.02, 128, 0, 255)
        return self.fc(q)


def _sample(n: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(n).normal(size=(n, 6)).astype(np.float32)}


@pytest.mark.parametrize(
    ("as_dict", "names"), [(True, ["logits", "score"]), (False, ["output_0", "output_1"])]
)
def test_every_output_is_named_dynamic_and_checked(
    tmp_path: Path, as_dict: bool, names: list[str]
) -> None:
    model = TwoHeads(as_dict).eval()
    assert output_names(model, _sample(2)) == names
    path = export_module(model, _sample(2), tmp_path / "m.onnx")
    sess = ort_session(path, 1)
    assert [o.name for o in sess.get_outputs()] == names
    got = sess.run(None, _sample(5))  # another batch size than the export's
    assert [g.shape for g in got] == [(5, 3), (5, 2)]
    check = verify_export(model, path, _sample(4), ExportConfig(), threads=1)
    assert sorted(check["outputs"]) == sorted(names) and check["kind"] == "fp32"
    assert check["max_abs_err"] < 1e-4 and check["cosine_min"] > 0.9999


def test_a_mismatch_names_the_output_that_disagrees(tmp_path: Path) -> None:
    model = TwoHeads(as_dict=True).eval()
    path = export_module(model, _sample(2), tmp_path / "m.onnx")
    with torch.no_grad():
        model.b.bias += 1.0  # only the second output changes after export
    with pytest.raises(ExportError, match="on output 'score'"):
        verify_export(model, path, _sample(4), ExportConfig(), threads=1)


def test_a_fake_quant_model_is_checked_with_the_qdq_tolerance(tmp_path: Path) -> None:
    model = FakeQuant().eval()
    path = export_module(model, _sample(2), tmp_path / "q.onnx")
    assert export_kind(path) == "qdq"
    with torch.no_grad():  # a small disagreement, as a rounding step of a QDQ model gives
        model.fc.bias += 0.01
    check = verify_export(model, path, _sample(8), ExportConfig(), threads=1)
    qdq = TOLERANCES["qdq"]
    assert check["limits"] == {"max_abs_err": qdq.max_abs_err, "min_cosine": qdq.min_cosine}
    assert check["max_abs_err"] > TOLERANCES["fp32"].max_abs_err  # a float model would fail
    strict = ExportConfig(max_abs_err=1e-3)  # the config overrides the kind's default
    with pytest.raises(ExportError, match=r"limit 0\.001"):
        verify_export(model, path, _sample(8), strict, threads=1)
