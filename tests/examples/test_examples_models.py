"""The built-in examples on their real models: accuracy, export to ONNX, cached weights.

``mnist`` trains its network on first use (about 2 minutes on 2 quiet cores) and caches the
weights under ``$SLIMLINE_CACHE`` (default ``~/.cache/slimline``), so a test run pays it once.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

from slimline.examples import minilm, mnist

pytestmark = pytest.mark.slow


def _ort(model: torch.nn.Module, args: tuple[torch.Tensor, ...], names: list[str]) -> Any:
    buf = io.BytesIO()
    # the tracer warns about Python-side shape checks in transformers' mask code; with a fixed
    # sequence length they are constants, and the test below checks other batches and padding
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _export(model, args, names, buf)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(buf.getvalue(), so, providers=["CPUExecutionProvider"])


def _export(
    model: torch.nn.Module, args: tuple[torch.Tensor, ...], names: list[str], buf: io.BytesIO
) -> None:
    torch.onnx.export(
        model,
        args,
        buf,  # type: ignore[arg-type]
        dynamo=False,
        opset_version=17,
        input_names=names,
        dynamic_axes={n: {0: "batch"} for n in names},
    )


@pytest.fixture(scope="module")
def mnist_model() -> Any:
    return mnist.model()


def test_mnist_reaches_97_percent_on_held_out_digits(mnist_model: torch.nn.Module) -> None:
    assert mnist.weights_path().is_file()
    assert not mnist_model.training
    outs, labels = [], []
    with torch.inference_mode():
        for inputs, lab in mnist.eval_data():
            outs.append(mnist_model(torch.from_numpy(inputs["x"])).numpy())
            labels.append(lab)
    # the example's claim (not a measured value): the trained model scores 0.982 on this
    # machine, which leaves 1.2 points for another CPU's training numerics
    assert mnist.metric(np.concatenate(outs), np.concatenate(labels)) >= 0.97


def test_mnist_exports_and_onnx_runtime_agrees(mnist_model: torch.nn.Module) -> None:
    x = next(iter(mnist.eval_data()))[0]["x"][:8]
    sess = _ort(mnist_model, (torch.from_numpy(x[:1]),), ["x"])
    got = sess.run(None, {"x": x})[0]
    with torch.inference_mode():
        want = mnist_model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def minilm_model() -> Any:
    return minilm.model()


def test_minilm_fp32_pearson_on_lee_corpus(minilm_model: torch.nn.Module) -> None:
    outs, labels = [], []
    with torch.inference_mode():
        for inputs, lab in minilm.eval_data():
            outs.append(minilm_model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).numpy())
            labels.append(lab)
    emb = np.concatenate(outs)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    # measured: 0.654 (FP32, 128 tokens); a broken pooling or mask falls far below
    assert minilm.metric(emb, np.concatenate(labels)) == pytest.approx(0.654, abs=0.01)


def test_minilm_exports_and_onnx_runtime_agrees(minilm_model: torch.nn.Module) -> None:
    batch = next(iter(minilm.calibration_data()))
    small = {k: v[:1] for k, v in batch.items()}  # traced at batch 1
    names = list(minilm.INPUT_NAMES)
    sess = _ort(minilm_model, tuple(torch.from_numpy(small[n]) for n in names), names)
    # a different batch size and different padding than the export sample
    probe = {k: v[5:11] for k, v in batch.items()}
    assert len(set(probe["attention_mask"].sum(axis=1))) > 1
    got = sess.run(None, probe)[0]
    with torch.inference_mode():
        want = minilm_model(**{k: torch.from_numpy(v) for k, v in probe.items()}).numpy()
    assert got.shape == (6, 384)
    np.testing.assert_allclose(got, want, atol=1e-4)
