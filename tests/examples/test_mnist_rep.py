"""The ``mnist-rep`` example: branch folding, training on a tiny configuration, the weights cache."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from slimline.examples import mnist, mnist_rep
from slimline.examples._repnet import RepConv
from slimline.task import load_task

TINY = mnist_rep.Arch(
    stem=8, blocks=((16, 1, 3, False), (16, 2, 5, True), (32, 1, 3, True)), head=32
)


def _randomize_bn(net: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            n = m.num_features
            assert m.running_mean is not None and m.running_var is not None
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.5)
            m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            m.weight.data.copy_(torch.randn(n, generator=g))
            m.bias.data.copy_(torch.randn(n, generator=g) * 0.1)


def test_folding_the_branches_keeps_the_function() -> None:
    torch.manual_seed(0)
    net = mnist_rep.build(TINY)
    _randomize_bn(net, 1)
    net.eval()
    x = torch.from_numpy(mnist._split()[2][:16])
    with torch.no_grad():
        want = net(x)
        got = net.fuse()(x)
    assert not any(isinstance(m, RepConv) for m in net.modules())
    # every depthwise and pointwise layer is now one plain convolution with a bias
    assert sum(isinstance(m, torch.nn.Conv2d) for m in net.modules()) > 2 * len(TINY.blocks)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_folded_form_of_each_branch_kind() -> None:
    """Depthwise with identity and 1x1 branches, strided (no identity), pointwise."""
    torch.manual_seed(2)
    for conv in (RepConv(6, 6, 3, 1, 6), RepConv(6, 6, 5, 2, 6), RepConv(6, 10, 1, 1, 1)):
        _randomize_bn(conv, 3)
        conv.eval()
        x = torch.randn(2, 6, 9, 9)
        with torch.no_grad():
            torch.testing.assert_close(conv.fused()(x), conv(x), atol=1e-5, rtol=1e-5)


def test_tiny_configuration_trains_and_loads_in_deployed_form() -> None:
    cfg = mnist_rep.TrainConfig(epochs=2, threads=1)
    state = mnist_rep.train_model(TINY, cfg)
    net = mnist_rep.deployed(TINY)
    net.load_state_dict(state)  # the state is the folded network's, key for key
    outs, labels = [], []
    with torch.inference_mode():
        for inputs, lab in mnist_rep.eval_data():
            outs.append(net(torch.from_numpy(inputs["x"])).numpy())
            labels.append(lab)
    # two epochs of a tiny network: far above chance (0.1), not the full example's accuracy
    assert mnist_rep.metric(np.concatenate(outs), np.concatenate(labels)) > 0.3


def test_weights_key_tracks_the_config() -> None:
    base = mnist_rep.weights_key()
    assert base == mnist_rep.weights_key(mnist_rep.Arch(), mnist_rep.TrainConfig())
    assert mnist_rep.weights_key(TINY) != base
    assert mnist_rep.weights_key(train=mnist_rep.TrainConfig(epochs=4)) != base
    assert base != mnist.weights_key()


def test_model_trains_once_then_loads_the_folded_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLIMLINE_CACHE", str(tmp_path))
    monkeypatch.setattr(mnist_rep, "SHIPPED_WEIGHTS", tmp_path / "none.safetensors")
    torch.manual_seed(3)
    state = mnist_rep.deployed().state_dict()
    calls = []

    def fake_train() -> Any:
        calls.append(1)
        return state

    monkeypatch.setattr(mnist_rep, "train_model", fake_train)
    first, second = mnist_rep.model(), mnist_rep.model()
    assert len(calls) == 1
    assert not first.training and not second.training
    assert not any(isinstance(m, RepConv) for m in second.modules())
    for k, v in state.items():
        assert torch.equal(second.state_dict()[k], v)


def test_the_shipped_weights_are_this_configurations_and_load_without_training(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    meta = mnist_rep.shipped_metadata()
    assert meta is not None, "src/slimline/examples/weights/mnist-rep.safetensors is missing"
    assert meta["key"] == mnist_rep.weights_key(), (
        "the configuration changed: rerun `python -m slimline.examples.mnist_rep`"
    )
    assert {"seed", "cpu", "torch"} <= set(meta)

    def no_training() -> dict[str, Any]:
        raise AssertionError("trained although the shipped weights match")

    monkeypatch.setattr(mnist_rep, "train_model", no_training)
    net = mnist_rep.model()
    assert not net.training and not any(isinstance(m, RepConv) for m in net.modules())


def test_registered_with_its_recipe() -> None:
    from slimline.commands import resolve_recipe

    task = load_task("mnist-rep")
    assert task.name == "mnist-rep" and task.metric_name == "top1"
    assert task.output_kind == "logits"
    recipe = resolve_recipe("mnist-rep-qat")
    assert recipe.task == "mnist-rep"
    assert [s.kind for s in recipe.steps] == ["export", "qat"]


def _outputs(net: torch.nn.Module, batches: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Outputs and labels of the first ``batches`` held-out batches (100 digits each)."""
    outs, labels = [], []
    with torch.no_grad():
        for inputs, lab in itertools.islice(mnist_rep.eval_data(), batches):
            outs.append(net(torch.from_numpy(inputs["x"])).numpy())
            labels.append(lab)
    return np.concatenate(outs), np.concatenate(labels)


@pytest.mark.slow
@pytest.mark.parametrize("reduce_range", [False, True], ids=["8-bit", "7-bit"])
def test_full_int8_ptq_of_the_trained_example_misses_its_budget(reduce_range: bool) -> None:
    """Fake-quantized full INT8 (U8 per-tensor activations at every op, S8 per-channel weights,
    MinMax ranges from 256 calibration rows) of the shipped weights falls far below the recipe's
    budget in both weight formats quantize deploys: 8-bit (VNNI) and 7-bit (AVX2 alone), on 400
    held-out digits. The simulation runs in float, so the shipped weights, not this CPU's INT8
    kernels, decide; bench/RESULTS-cpu-kinds.md has the figures per kind."""
    from slimline.commands import resolve_recipe
    from slimline.compress.qat.fakequant import FakeQuantFormat, calibrate, prepare

    budget = resolve_recipe("mnist-rep-qat").budget
    fp32 = mnist_rep.model()
    ref, labels = _outputs(fp32, 4)
    example = next(iter(mnist_rep.calibration_data()))
    fmt = FakeQuantFormat(reduce_range=reduce_range)
    fq = prepare(fp32, {k: torch.from_numpy(v) for k, v in example.items()}, fmt)
    calibrate(fq, mnist_rep.calibration_data(), 256)
    out, _ = _outputs(fq.eval(), 4)
    cosine = float(
        np.mean((out * ref).sum(1) / (np.linalg.norm(out, axis=1) * np.linalg.norm(ref, axis=1)))
    )
    drop = mnist_rep.metric(ref, labels) - mnist_rep.metric(out, labels)
    assert cosine < budget.min_cosine - 0.02
    assert drop > budget.max_metric_drop
