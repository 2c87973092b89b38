"""Export names every output, makes every batch axis dynamic and checks every output within the
tolerance of the model's kind (float or fake-quant QDQ); the config can override it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from slimline.errors import ExportError
from slimline.export import (
    TOLERANCES,
    ExportConfig,
    _export_verified,
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

    def forward(self, x: torch.Tensor) -> Any:
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
        model.b.bias.add_(1.0)  # only the second output changes after export
    with pytest.raises(ExportError, match="on output 'score'"):
        verify_export(model, path, _sample(4), ExportConfig(), threads=1)


def test_a_fake_quant_model_is_checked_with_the_qdq_tolerance(tmp_path: Path) -> None:
    model = FakeQuant().eval()
    path = export_module(model, _sample(2), tmp_path / "q.onnx")
    assert export_kind(path) == "qdq"
    with torch.no_grad():  # a small disagreement, as a rounding step of a QDQ model gives
        model.fc.bias.add_(0.01)
    check = verify_export(model, path, _sample(8), ExportConfig(), threads=1)
    qdq = TOLERANCES["qdq"]
    assert check["limits"] == {"max_abs_err": qdq.max_abs_err, "min_cosine": qdq.min_cosine}
    assert check["max_abs_err"] > TOLERANCES["fp32"].max_abs_err  # a float model would fail
    strict = ExportConfig(max_abs_err=1e-3)  # the config overrides the kind's default
    with pytest.raises(ExportError, match=r"limit 0\.001"):
        verify_export(model, path, _sample(8), strict, threads=1)


class Frames(torch.nn.Module):
    """Frames of a padded signal by ``Tensor.unfold``, as STFT front ends do: the TorchScript
    exporter cannot export unfold of a dynamic size, the dynamo exporter can."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> Any:
        x = torch.nn.functional.pad(x, (4, 4), mode="reflect")
        return self.fc(x.unfold(-1, 8, 4)).mean(1)


def _signal(n: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(n).normal(size=(n, 32)).astype(np.float32)}


def test_auto_falls_back_to_the_dynamo_exporter_and_records_it(tmp_path: Path) -> None:
    ctx = SimpleNamespace(workdir=tmp_path, threads=1)
    cfg = ExportConfig()
    assert cfg.exporter == "auto"
    path, check, exporter, failed = _export_verified(Frames(), _signal(4), cfg, ctx)  # type: ignore[arg-type]
    assert exporter == "dynamo"
    assert "torchscript exporter" in failed["torchscript"] and "Unfold" in failed["torchscript"]
    assert "forward()" not in failed["torchscript"]  # the module is fine: no advice to change it
    assert check["cosine_min"] > 0.9999
    batch = ort_session(path, 1).get_inputs()[0].shape[0]
    assert not isinstance(batch, int)  # the batch axis stays dynamic
    got = ort_session(path, 1).run(None, _signal(3))[0]
    with torch.no_grad():
        ref = Frames()(torch.from_numpy(_signal(3)["x"])).numpy()
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_an_exporter_named_in_the_config_is_the_only_one_tried(tmp_path: Path) -> None:
    ctx = SimpleNamespace(workdir=tmp_path, threads=1)
    with pytest.raises(ExportError, match="torchscript exporter"):
        _export_verified(Frames(), _signal(4), ExportConfig(exporter="torchscript"), ctx)  # type: ignore[arg-type]
    _, _, exporter, failed = _export_verified(
        TwoHeads(False),
        _sample(4),
        ExportConfig(),
        ctx,  # type: ignore[arg-type]
    )
    assert (exporter, failed) == ("torchscript", {})
