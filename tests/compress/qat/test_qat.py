"""The qat step: the simulated format, the QDQ export, resuming, bad input, recipe order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.ao.quantization import FakeQuantize

from fixtures.int8_kinds import skip_8bit_weights_where_they_saturate
from slimline import api
from slimline.compress.finetune import FileCheckpoint, FinetuneConfig, distill
from slimline.compress.pruning.step import PruneConfig
from slimline.compress.qat import fakequant as fq
from slimline.compress.qat.step import QatConfig, QatHooks, _check_data, _export
from slimline.compress.quant.config import QuantizeConfig
from slimline.compress.quant.fallback import kernel_report
from slimline.cpu import parse_cpuinfo
from slimline.errors import DataError, ExportError
from slimline.export import ExportConfig, export_module
from slimline.recipe import recipe_from_dict
from slimline.steps import check_order, start_forms
from slimline.task import load_task

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane

CPUINFO = Path(__file__).parents[2] / "fixtures" / "cpuinfo"
DIGITS = Path(__file__).parents[1] / "pruning" / "digits_task.py"


class TinyDw(nn.Module):
    """Conv-BN-ReLU, a depthwise Conv-BN-ReLU, a 1x1 projection with a residual add, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.dw = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), nn.ReLU()
        )
        self.pw = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        y = y + self.pw(self.dw(y))
        out: torch.Tensor = self.fc(y.mean((2, 3)))
        return out


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    net = TinyDw()
    with torch.no_grad():  # BatchNorm statistics that are not the identity
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                assert m.running_mean is not None and m.running_var is not None
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
    return net.eval()


def _batches(n: int = 4, rows: int = 8) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(rows, 1, 8, 8)).astype(np.float32)} for _ in range(n)]


def _prepared(reduce_range: bool = False) -> Any:
    fmt = fq.FakeQuantFormat(reduce_range=reduce_range)
    model = fq.prepare(_tiny(), {"x": torch.from_numpy(_batches()[0]["x"])}, fmt)
    fq.calibrate(model, _batches(), 32)
    return model


@pytest.mark.parametrize(
    ("cpu", "reduce_range", "weight_range"),
    [("amx", False, (-127, 127)), ("avx512-vnni", False, (-127, 127)), ("avx2", True, (-64, 64))],
)
def test_fake_quant_format_is_what_quantize_deploys_on_the_cpu(
    cpu: str, reduce_range: bool, weight_range: tuple[int, int]
) -> None:
    fmt = fq.format_for(parse_cpuinfo((CPUINFO / f"{cpu}.txt").read_text(), "x86_64"))
    assert fmt.reduce_range is reduce_range and fmt.weight_range == weight_range
    model = fq.prepare(_tiny(), {"x": torch.zeros(2, 1, 8, 8)}, fmt)
    found = list(fq.fake_quant_modules(model).values())
    quants = [m for m in found if isinstance(m, FakeQuantize)]
    assert len(quants) == len(found)  # prepare() inserts FakeQuantize modules only
    weights = [m for m in quants if m.qscheme == torch.per_channel_symmetric]
    acts = [m for m in quants if m.qscheme == torch.per_tensor_affine]
    assert len(weights) == 4  # stem, depthwise, projection, head
    assert all((m.quant_min, m.quant_max) == weight_range and m.ch_axis == 0 for m in weights)
    assert all(m.dtype == torch.qint8 for m in weights)
    assert acts and all((m.quant_min, m.quant_max, m.dtype) == (0, 255, torch.quint8) for m in acts)


def test_calibration_sets_the_activation_ranges_to_min_max() -> None:
    model = _prepared()
    first = fq.fake_quant_modules(model)["activation_post_process_0"]  # the model input
    assert isinstance(first, FakeQuantize)
    x = np.concatenate([b["x"] for b in _batches()])
    obs = first.activation_post_process
    assert float(obs.min_val) == pytest.approx(float(x.min()))
    assert float(obs.max_val) == pytest.approx(float(x.max()))
    assert float(first.scale) == pytest.approx((x.max() - x.min()) / 255, rel=1e-4)


@pytest.mark.parametrize("reduce_range", [False, True])
def test_qdq_export_matches_the_fake_quant_model_and_runs_int8(
    tmp_path: Path, reduce_range: bool
) -> None:
    skip_8bit_weights_where_they_saturate(reduce_range)
    model = _prepared(reduce_range).eval()
    exported = fq.export_module_for(model)
    x = _batches(1, 16)[0]
    with torch.no_grad():
        want = model(torch.from_numpy(x["x"])).numpy()
        same = exported(torch.from_numpy(x["x"])).numpy()
    path = export_module(exported, x, tmp_path / "q.onnx")
    import onnxruntime as ort

    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, x)[0]
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.mean() >= 0.999  # the step's check; single rows may flip a rounding step
    np.testing.assert_allclose(same, want, atol=0.05 * np.abs(want).max())
    report = kernel_report(path)
    assert report["int8_kernels"] == report["compute_kernels"] == 4, report


class _Killed(Exception):
    pass


class _KillAfterFirstSave(FileCheckpoint):
    def save(self, state: dict[str, Any]) -> None:
        super().save(state)
        raise _Killed


def test_a_killed_qat_run_resumes_inside_the_step(tmp_path: Path) -> None:
    teacher = _tiny()
    data = [(b, None) for b in _batches(8)]
    cfg = QatConfig(freeze_bn_after=1, freeze_observers_after=3)
    ft = FinetuneConfig(steps=6, eval_every=2, patience=10, val_batches=1, progress=False)

    def student() -> Any:
        return _prepared()

    with pytest.raises(_Killed):
        distill(
            student(), teacher, lambda: data, ft, output_kind="logits",
            checkpoint=_KillAfterFirstSave(tmp_path / "t.pt", "qat"), hooks=QatHooks(cfg),
        )  # fmt: skip
    hooks = QatHooks(cfg)
    result = distill(
        student(), teacher, lambda: data, ft, output_kind="logits",
        checkpoint=FileCheckpoint(tmp_path / "t.pt", "qat"), hooks=hooks,
    )  # fmt: skip
    assert result.resumed_from_step == 2 and result.steps == 6
    rec = hooks.record(result.steps)
    assert rec["batchnorm_frozen_at"] == 1  # the checkpoint keeps when it froze; re-applied
    assert rec["observers_frozen_at"] == 3


def test_qat_without_calibration_data_names_what_the_task_must_define() -> None:
    from types import SimpleNamespace

    ctx: Any = SimpleNamespace(task=SimpleNamespace(name="t", calibration_data=lambda: iter(())))
    with pytest.raises(DataError, match=r"calibration_data\(\)"):
        _check_data(ctx)


class _Odd(nn.Module):
    """An op the TorchScript exporter has no ONNX form for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cummax(x, 3)[0]


class _WithOdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.odd = _Odd()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.odd(self.conv(x)).mean((2, 3)))
        return out


def test_an_export_failure_names_the_module_and_the_op(tmp_path: Path) -> None:
    from types import SimpleNamespace

    fmt = fq.FakeQuantFormat()
    model = fq.prepare(_WithOdd().eval(), {"x": torch.zeros(2, 1, 8, 8)}, fmt)
    fq.calibrate(model, _batches(), 16)
    batch = _batches(1)[0]
    task = SimpleNamespace(sample_inputs=lambda n: {"x": batch["x"][:n]})
    ctx: Any = SimpleNamespace(task=task, workdir=tmp_path, threads=1)
    with pytest.raises(ExportError, match=r"module odd \(_Odd\).*aten::cummax"):
        _export(QatConfig(), model.eval(), ctx)


def test_recipe_order_qat_needs_a_float_model() -> None:
    torch_task = start_forms(onnx_task=False)
    assert check_order([ExportConfig(), QatConfig()], torch_task) is None
    assert check_order([ExportConfig(), PruneConfig(), QatConfig()], torch_task) is None
    assert check_order([QatConfig(), QuantizeConfig()], torch_task) is not None  # int8 then float
    bad = check_order([QuantizeConfig(), QatConfig()], torch_task)
    assert bad is not None and "put qat before quantize" in bad
    assert check_order([QatConfig()], start_forms(onnx_task=True)) is None  # converted


def test_qat_and_fallback_configs_round_trip() -> None:
    for steps in (
        [{"qat": {"freeze_bn_after": 5, "finetune": {"steps": 10}}}],
        [{"quantize": {"fallback": "qat"}}],
    ):
        rec = recipe_from_dict({"name": "t", "task": "mnist-dw", "steps": steps})
        assert recipe_from_dict(rec.to_dict()) == rec
    qat = recipe_from_dict(
        {"name": "t", "task": "mnist-dw", "steps": [{"qat": {"freeze_bn_after": 5}}]}
    ).step_config(QatConfig)
    assert qat.freeze_bn_after == 5
    partial = QatConfig.model_validate({"finetune": {"steps": 10}}).finetune
    assert (partial.steps, partial.lr_scale, partial.eval_every) == (10, 0.01, 25)
    assert qat.finetune.lr_scale == 0.01  # QAT's default: 0.01x the training learning rate
    with pytest.raises(ValueError, match="fallback"):
        QuantizeConfig(fallback="retrain")


# QAT training of the digits CNN: over 7 minutes under the emulated lane (2 s natively); there the
# same formats and exports are checked on the tiny CNN (test_qdq_export_..., test_qat_export_check)
@pytest.mark.emulation_slow
def test_qat_step_on_a_real_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step end to end on scikit-learn's digits (a trained CNN): a QDQ file whose INT8 ops
    all run as integer kernels, checked against the fake-quant model, within budget."""
    import slimline.pipeline.run as pipeline

    monkeypatch.setattr(pipeline, "cache_dir", lambda *p: _mk(tmp_path.joinpath("c", *p)))
    task = load_task(str(DIGITS))
    rec = recipe_from_dict(
        {"name": "t", "task": task.source, "target": {"threads": 1},
         "budget": {"max_metric_drop": 0.05, "min_cosine": 0.95}}
    )  # fmt: skip
    assert task.model is not None
    ctx = api.context_for(task, rec, tmp_path / "w", timed=False, cache=tmp_path / "c")
    cfg = QatConfig(
        finetune=FinetuneConfig(steps=4, eval_every=2, lr_scale=0.05, progress=False),
        freeze_bn_after=2,
        compare_ptq=True,
    )
    out = api.run_step(ctx, cfg, ctx.baseline)
    assert out.onnx is not None and out.onnx.is_file()
    assert out.meta["export_check"]["cosine_mean"] >= 0.999
    assert out.meta["export_check"]["int8_weights"] == 7  # six convolutions and the head
    import onnx

    weights = [i for i in onnx.load(str(out.onnx)).graph.initializer if len(i.dims) >= 2]
    assert weights and all(w.data_type == onnx.TensorProto.INT8 for w in weights)
    assert out.meta["kernels"]["int8_share"] == 1.0
    assert out.meta["freezing"]["batchnorm_frozen_at"] == 2
    rows = out.meta["comparison"]["rows"]
    assert {"fp32", "ptq_full", "qat"} <= set(rows)
    assert rows["qat"]["budget_ok"], rows["qat"]
    assert not list((tmp_path / "c" / "work").glob("*/train.pt"))  # state removed when done


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.parametrize(
    ("budget_ok", "int8_share", "record", "expected"),
    [
        (False, 1.0, {}, "missed the budget"),
        (True, 1.0, {"no_candidate_met_budget": "none"}, "missed the budget"),
        (True, 0.3, {}, "70% of the compute ops in float"),
        (True, 0.9, {}, None),
    ],
)
def test_quantize_falls_back_to_qat_when_ptq_is_not_good_enough(
    budget_ok: bool, int8_share: float, record: dict[str, Any], expected: str | None
) -> None:
    from types import SimpleNamespace

    from slimline.compress.qat.fallback import why_qat

    chosen: Any = SimpleNamespace(
        budget_ok=budget_ok, budget_reason="cosine 0.97 < 0.99", kernels={"int8_share": int8_share}
    )
    why = why_qat(QuantizeConfig(fallback="qat", max_float_share=0.5), chosen, record)  # type: ignore[arg-type]
    assert why == expected if expected is None else expected in (why or "")


# QAT training of the digits CNN: over 7 minutes under the emulated lane (2 s natively); there the
# same formats and exports are checked on the tiny CNN (test_qdq_export_..., test_qat_export_check)
@pytest.mark.emulation_slow
def test_quantize_fallback_runs_qat_and_keeps_both_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget PTQ cannot meet: quantize runs QAT; the one not returned is an alternative."""
    import slimline.compress.qat.fallback as fallback
    import slimline.pipeline.run as pipeline

    monkeypatch.setattr(pipeline, "cache_dir", lambda *p: _mk(tmp_path.joinpath("c", *p)))
    short = QatConfig(finetune=FinetuneConfig(steps=2, eval_every=2, progress=False))
    monkeypatch.setattr(fallback, "QatConfig", lambda: short)
    task = load_task(str(DIGITS))
    rec = recipe_from_dict(
        {"name": "t", "task": task.source, "target": {"threads": 1},
         "budget": {"max_metric_drop": 0.0, "min_cosine": 0.999999}}
    )  # fmt: skip
    ctx = api.context_for(task, rec, tmp_path / "w", timed=False, cache=tmp_path / "c")
    cfg = QuantizeConfig(mode="static", fallback="qat", mixed_precision=False, samples=64)
    out = api.run_step(ctx, cfg, ctx.baseline)
    assert "missed the budget" in out.meta["qat_fallback"]
    assert out.step == "quantize"  # QAT missed this budget too: PTQ stays, QAT is recorded
    qat = [a for a in ctx.alternatives if a.step == "qat"]
    assert len(qat) == 1 and qat[0].reason.startswith("QAT fallback:")
    assert qat[0].meta["fallback_from"]["ptq"] == "quantize"
