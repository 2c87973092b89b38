"""The qat step's range options: histogram calibration (entropy, percentile) and learned ranges
(LSQ), their export with the learned scales, and their configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.ao.quantization import FakeQuantize

from slimline.compress.finetune import FinetuneConfig, distill
from slimline.compress.qat import fakequant as fq
from slimline.compress.qat._modules import LearnedRange
from slimline.compress.qat.step import QatConfig, QatHooks
from slimline.cpu import detect
from slimline.export import export_module
from slimline.recipe import recipe_from_dict

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.conv(x).mean((2, 3)))
        return out


def _net() -> nn.Module:
    torch.manual_seed(0)
    return TinyNet().eval()


def _outlier_batches(n: int = 4, rows: int = 8) -> list[dict[str, np.ndarray]]:
    """Normal inputs with one large outlier per batch: min / max is set by the outliers."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        x = rng.normal(size=(rows, 1, 8, 8)).astype(np.float32)
        x[0, 0, 0, i] = 40.0
        out.append({"x": x})
    return out


def _prepared(method: Any) -> Any:
    batches = _outlier_batches()
    fmt = fq.format_for(detect())  # the CPU's format: ONNX Runtime runs its kernels in the tests
    model = fq.prepare(_net(), {"x": torch.from_numpy(batches[0]["x"])}, fmt)
    fq.calibrate(model, batches, 32, method)
    return model


def _input_range(model: Any) -> tuple[float, float]:
    first = fq.fake_quant_modules(model)["activation_post_process_0"]  # the model input
    assert isinstance(first, FakeQuantize | LearnedRange)
    scale, zp = float(first.scale), int(first.zero_point)
    return -zp * scale, (255 - zp) * scale


@pytest.mark.parametrize("method", ["entropy"])  # percentile 99.99 keeps 4 in 2048
def test_histogram_calibration_clips_the_outliers_that_min_max_keeps(method: str) -> None:
    _, hi_mm = _input_range(_prepared("minmax"))
    assert hi_mm == pytest.approx(40.0, rel=0.01)
    lo, hi = _input_range(_prepared(method))
    assert hi < 0.5 * hi_mm  # the 4 outliers in 2048 values are clipped
    assert lo < -1.0 < 1.0 < hi  # the bulk of the normal values stays inside


def test_entropy_ranges_are_onnx_runtimes_entropy_thresholds() -> None:
    from onnxruntime.quantization.calibrate import HistogramCollector

    from slimline.compress.quant.calibrate import ENTROPY_BINS

    x = np.concatenate([b["x"] for b in _outlier_batches()])
    coll = HistogramCollector("entropy", False, ENTROPY_BINS, 128, 99.99, "same")
    coll.collect({"x": x})
    want_lo, want_hi = (float(v) for v in coll.compute_collection_result()["x"][:2])
    lo, hi = _input_range(_prepared("entropy"))
    step = (want_hi - want_lo) / 255
    assert lo == pytest.approx(want_lo, abs=step) and hi == pytest.approx(want_hi, abs=step)


def test_learned_ranges_start_where_calibration_put_them() -> None:
    model = _prepared("minmax").eval()
    fq.freeze_observers(model)  # else evaluating moves the moving-average ranges
    x = torch.from_numpy(_outlier_batches(1)[0]["x"])
    with torch.no_grad():
        before = model(x)
    assert fq.learn_ranges(model) == 3  # input, convolution output, head output
    assert len(fq.range_parameters(model)) == 3
    with torch.no_grad():
        after = model(x)
    torch.testing.assert_close(after, before)


def test_a_learned_range_gets_the_lsq_gradient() -> None:
    q = LearnedRange(0.1, 0, 0, 255)
    x = torch.tensor([0.04, 0.14, 30.0])  # 0.4 and 1.4 steps in range, one value clipped at 25.5
    q(x).sum().backward()
    grad = q.log_gain.grad
    assert grad is not None
    # d/ds of s*clamp(round(x/s)): round(x/s) - x/s inside the range, quant_max above it;
    # the scale is s0 * exp(gain), so the gain's gradient is s times that, times LSQ's
    # gradient scale 1 / sqrt(values x largest level)
    want = 0.1 * ((0.0 - 0.4) + (1.0 - 1.4) + 255.0) / (3 * 255) ** 0.5
    assert float(grad) == pytest.approx(want, rel=1e-4)


def test_distillation_trains_the_ranges_and_the_export_carries_them(tmp_path: Path) -> None:
    import onnx
    from onnx import numpy_helper

    model = _prepared("minmax")
    fq.learn_ranges(model)
    gains: list[list[float]] = []

    def seen(step: int, loss: float) -> None:  # the gains during training (the best are kept)
        gains.append([float(p.detach()) for p in fq.range_parameters(model)])

    cfg = QatConfig(learn_ranges=True, range_lr=0.05)
    data = [(b, None) for b in _outlier_batches(6)]
    ft = FinetuneConfig(steps=6, eval_every=6, patience=5, val_batches=1, progress=False)
    distill(
        model, _net(), lambda: data, ft, output_kind="logits", hooks=QatHooks(cfg), on_step=seen
    )
    assert len(gains) == 6 and all(g != 0.0 for g in gains[-1])  # every range moved
    first = fq.fake_quant_modules(model)["activation_post_process_0"]
    assert isinstance(first, FakeQuantize | LearnedRange)
    path = export_module(
        fq.export_module_for(model.eval()), _outlier_batches(1)[0], tmp_path / "q.onnx"
    )
    graph = onnx.load(str(path)).graph
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    quant = next(n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x")
    assert float(consts[quant.input[1]].reshape(-1)[0]) == pytest.approx(
        float(first.scale), rel=1e-6
    )


def test_the_learned_ranges_train_at_their_own_learning_rate() -> None:
    model = _prepared("minmax")
    fq.learn_ranges(model)
    hooks = QatHooks(QatConfig(learn_ranges=True, range_lr=0.02))
    params = [p for p in model.parameters() if p.requires_grad]
    groups = hooks.param_groups(model, params)
    assert len(groups) == 2 and groups[1]["lr"] == 0.02
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in fq.range_parameters(model)}
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(params)


def test_range_options_round_trip_and_are_validated() -> None:
    step = {"qat": {"calibration": "entropy", "learn_ranges": True, "range_lr": 0.01}}
    rec = recipe_from_dict({"name": "t", "task": "mnist-dw", "steps": [step]})
    assert recipe_from_dict(rec.to_dict()) == rec
    qat = rec.step_config(QatConfig)
    assert (qat.calibration, qat.learn_ranges, qat.range_lr) == ("entropy", True, 0.01)
    with pytest.raises(ValueError, match="calibration"):
        QatConfig(calibration="kl")


def test_learned_weight_ranges_train_and_export_as_int8(tmp_path: Path) -> None:
    import onnxruntime as ort

    from slimline.compress.qat._modules import LearnedWeightRange, QConv2d

    model = _prepared("minmax")
    fq.freeze_observers(model)
    x = _outlier_batches(1)[0]
    with torch.no_grad():
        before = model.eval()(torch.from_numpy(x["x"]))
    assert fq.learn_ranges(model, weights=True) == 5  # 3 activations, conv and fc weights
    weights = [m for m in model.modules() if isinstance(m, LearnedWeightRange)]
    assert [len(m.log_gain) for m in weights] == [4, 3]  # one scale per output channel
    with torch.no_grad():
        torch.testing.assert_close(model(torch.from_numpy(x["x"])), before)
    start = weights[0].scale.clone()
    data = [(b, None) for b in _outlier_batches(6)]
    ft = FinetuneConfig(steps=6, eval_every=6, patience=5, val_batches=1, progress=False)
    cfg = QatConfig(learn_ranges=True, learn_weight_ranges=True, range_lr=0.05)
    seen: list[torch.Tensor] = []
    distill(
        model,
        _net(),
        lambda: data,
        ft,
        output_kind="logits",
        hooks=QatHooks(cfg),
        on_step=lambda step, loss: seen.append(weights[0].scale.clone()),
    )
    assert not torch.equal(seen[-1], start)  # the best weights kept may be the first ones
    with torch.no_grad():  # scales moved by training, whichever are kept
        weights[0].log_gain.add_(0.1)
    exported = fq.export_module_for(model.eval())
    conv = next(m for m in exported.modules() if isinstance(m, QConv2d))
    torch.testing.assert_close(conv.scale, weights[0].scale)
    with torch.no_grad():
        want = model(torch.from_numpy(x["x"])).numpy()
    path = export_module(exported, x, tmp_path / "q.onnx")
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, x)[0]
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.mean() >= 0.999


def test_recovery_is_also_given_against_ptq_with_qats_calibration() -> None:
    from slimline.compress.qat.compare import _verdicts

    rows: dict[str, dict[str, Any]] = {
        "fp32": {"metric": 1.0, "cosine_mean": 1.0},
        "ptq_full": {"metric": 0.6, "cosine_mean": 0.8},
        "ptq_full_calibrated": {"metric": 0.8, "cosine_mean": 0.9},
        "qat": {"metric": 0.9, "cosine_mean": 0.95},
    }
    v = _verdicts(rows)
    assert v["metric_recovered_share"] == pytest.approx(0.75)
    assert v["cosine_mean_recovered_share"] == pytest.approx(0.75)
    assert v["metric_recovered_share_vs_calibrated"] == pytest.approx(0.5)
    assert v["cosine_mean_recovered_share_vs_calibrated"] == pytest.approx(0.5)
    assert v["metric_lost_by_ptq_vs_calibrated"] == pytest.approx(0.2)


def test_learned_zero_points_move_and_export_rounded(tmp_path: Path) -> None:
    import onnxruntime as ort

    model = _prepared("minmax")
    fq.freeze_observers(model)
    assert fq.learn_ranges(model, zero_points=True) == 3
    offsets = fq.offset_parameters(model)
    assert len(offsets) == 3
    start = [float(o.detach()) for o in offsets]
    cfg = QatConfig(learn_ranges=True, learn_zero_points=True, offset_lr=2.0)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = QatHooks(cfg).param_groups(model, params)
    assert [g.get("lr") for g in groups[1:]] == [cfg.range_lr, 2.0]
    moved: list[list[float]] = []
    data = [(b, None) for b in _outlier_batches(6)]
    ft = FinetuneConfig(steps=6, eval_every=6, patience=5, val_batches=1, progress=False)
    distill(
        model,
        _net(),
        lambda: data,
        ft,
        output_kind="logits",
        hooks=QatHooks(cfg),
        on_step=lambda step, loss: moved.append([float(o.detach()) for o in offsets]),
    )
    assert any(abs(a - b) > 0.5 for a, b in zip(moved[-1], start, strict=True))
    with torch.no_grad():  # a zero point off the integer grid: export and evaluation round it
        offsets[1].add_(0.3)
    x = _outlier_batches(1)[0]
    exported = fq.export_module_for(model.eval())
    with torch.no_grad():
        want = model(torch.from_numpy(x["x"])).numpy()
        torch.testing.assert_close(exported(torch.from_numpy(x["x"])).numpy(), want)
    path = export_module(exported, x, tmp_path / "q.onnx")
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, x)[0]
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.mean() >= 0.999
