"""The built-in examples follow the task contract; cheap checks (no model is loaded)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy.stats import pearsonr

from slimline.errors import DataError
from slimline.examples import DESCRIPTIONS, EXAMPLES, minilm, mnist
from slimline.task import load_task


def test_registry_lists_importable_task_modules() -> None:
    assert set(EXAMPLES) == {"mnist", "minilm", "mnist-dw", "mnist-rep"}
    assert set(DESCRIPTIONS) == set(EXAMPLES)
    for name, module in EXAMPLES.items():
        task = load_task(name)
        assert task.name == name
        assert task.module is importlib.import_module(module)
    assert load_task("mnist").metric_name == "top1"
    assert load_task("mnist").output_kind == "logits"
    assert load_task("mnist-dw").metric_name == "top1"
    assert load_task("minilm").metric_name == "lee_pearson"
    assert load_task("minilm").output_kind == "embedding"


def test_importing_examples_loads_no_model_library() -> None:
    code = (
        "import os, sys, slimline.examples.mnist, slimline.examples.minilm; "
        "print(sorted(m for m in ('torch', 'transformers', 'mlxtend', 'gensim') if m in sys.modules)); "
        "print(os.environ.get('HF_HUB_OFFLINE'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == ["[]", "1"]  # offline before transformers is ever imported


# ---------------------------------------------------------------------------------------------
# mnist


def test_mnist_split_is_fixed_balanced_and_disjoint() -> None:
    xtr, ytr, xte, yte = mnist._split()
    assert xtr.shape == (4000, 1, 28, 28) and xte.shape == (1000, 1, 28, 28)
    assert xtr.dtype == np.float32 and ytr.dtype == np.int64
    assert np.bincount(ytr).tolist() == [400] * 10
    assert np.bincount(yte).tolist() == [100] * 10
    # normalised with the MNIST constants: background pixels are (0 - mean) / std
    assert xtr.min() == pytest.approx(-mnist.MEAN / mnist.STD)
    assert abs(float(xtr.mean())) < 0.2 and 0.8 < float(xtr.std()) < 1.2
    train_rows = {r.tobytes() for r in xtr.reshape(4000, -1)}
    assert not any(r.tobytes() in train_rows for r in xte.reshape(1000, -1))


def test_mnist_batches_match_the_contract() -> None:
    calib = list(mnist.calibration_data())
    assert sum(len(b["x"]) for b in calib) == 4000
    assert all(set(b) == {"x"} and b["x"].dtype == np.float32 for b in calib)
    assert calib[0]["x"].shape == (mnist.CALIBRATION_BATCH, 1, 28, 28)
    evals = list(mnist.eval_data())
    assert sum(len(lab) for _, lab in evals) == 1000
    x, lab = evals[0]
    assert x["x"].shape == (mnist.EVAL_BATCH, 1, 28, 28) and lab.dtype == np.int64
    tr = list(mnist.train_data())
    assert sum(len(lab) for _, lab in tr) == 4000
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in calib]), mnist._split()[0])


def test_mnist_metric_and_loss() -> None:
    labels = np.arange(10).repeat(10)
    perfect = np.eye(10, dtype=np.float32)[labels] * 5.0
    assert mnist.metric(perfect, labels) == 1.0
    wrong = np.roll(perfect, 1, axis=1)
    assert mnist.metric(wrong, labels) == 0.0
    half = perfect.copy()
    half[:50] = wrong[:50]
    assert mnist.metric(half, labels) == 0.5
    import torch

    loss = mnist.loss(torch.from_numpy(perfect), labels)
    expected = torch.nn.functional.cross_entropy(
        torch.from_numpy(perfect), torch.from_numpy(labels)
    )
    assert float(loss) == pytest.approx(float(expected))


def test_mnist_weights_key_tracks_the_config() -> None:
    base = mnist.weights_key()
    assert base == mnist.weights_key(mnist.Arch(), mnist.TrainConfig())
    assert mnist.weights_key(mnist.Arch(stem=32)) != base
    assert mnist.weights_key(train=mnist.TrainConfig(epochs=4)) != base


def test_mnist_network_shapes() -> None:
    import torch

    net = mnist.build().eval()
    with torch.no_grad():
        out = net(torch.zeros(3, 1, 28, 28))
    assert out.shape == (3, 10)
    bns = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) >= 10


# ---------------------------------------------------------------------------------------------
# minilm


def test_minilm_texts_are_real_disjoint_and_deterministic() -> None:
    calib, train = minilm.calibration_sentences(), minilm.train_sentences()
    assert len(calib) >= 1000 and len(train) >= 1000
    assert not set(calib) & set(train)
    assert all(len(s.split()) >= minilm.MIN_WORDS for s in calib + train)
    assert calib[0].startswith("Hundreds of people have been forced to vacate their homes")
    docs = minilm.lee_documents()
    assert len(docs) == 50
    assert not {s for d in docs for s in minilm.split_sentences(d)} & set(calib + train)


def test_minilm_split_sentences() -> None:
    text = 'He said "Go home now." Then the crowd left quickly. It cost $5 million. 3 people stayed on.'
    assert minilm.split_sentences(text) == [
        'He said "Go home now."',
        "Then the crowd left quickly.",
        "It cost $5 million.",
        "3 people stayed on.",
    ]


def test_minilm_similarity_matrix() -> None:
    s = minilm.lee_similarities()
    assert s.shape == (50, 50)
    np.testing.assert_array_equal(s, s.T)
    np.testing.assert_array_equal(np.diag(s), np.ones(50))
    assert s.min() >= 0.0 and s.max() <= 1.0
    raw = np.loadtxt(minilm.data_dir() / "similarities0-1.txt")
    np.testing.assert_array_equal(np.triu(s, 1), np.triu(raw, 1))


def test_minilm_batches_match_the_contract() -> None:
    batch = next(iter(minilm.calibration_data()))
    assert set(batch) == {"input_ids", "attention_mask"}
    for v in batch.values():
        assert v.dtype == np.int64 and v.shape == (minilm.BATCH, minilm.SEQ_LEN)
    assert (batch["input_ids"][:, 0] == 101).all()  # [CLS]
    assert set(np.unique(batch["attention_mask"])) <= {0, 1}
    assert sum(len(b["input_ids"]) for b in minilm.calibration_data()) == len(
        minilm.calibration_sentences()
    )
    evals = list(minilm.eval_data())
    assert sum(len(lab) for _, lab in evals) == 50
    labels = np.concatenate([lab for _, lab in evals])
    np.testing.assert_allclose(labels, minilm.lee_similarities(), atol=1e-7)
    inputs, lab = next(iter(minilm.train_data()))
    assert lab is None and inputs["input_ids"].shape == (minilm.BATCH, minilm.SEQ_LEN)


def _unit(rng: np.random.Generator, n: int, d: int) -> Any:
    e = rng.standard_normal((n, d))
    return e / np.linalg.norm(e, axis=1, keepdims=True)


def test_minilm_metric_equals_scipy_pearson_on_upper_triangle() -> None:
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((20, 8)) * rng.uniform(0.5, 3, (20, 1))  # not unit norm
    ratings = rng.uniform(0, 1, (20, 20))
    iu = np.triu_indices(20, k=1)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    expected = pearsonr((unit @ unit.T)[iu], ratings[iu]).statistic
    assert minilm.metric(emb, ratings) == pytest.approx(expected, abs=1e-12)
    # only the upper triangle counts
    ratings_lower_changed = ratings + np.tril(rng.uniform(0, 5, (20, 20)), k=-1)
    assert minilm.metric(emb, ratings_lower_changed) == pytest.approx(expected, abs=1e-12)


def test_minilm_metric_perfect_random_and_limited() -> None:
    rng = np.random.default_rng(1)
    emb = _unit(rng, 50, 16)
    perfect = emb @ emb.T
    assert minilm.metric(emb.astype(np.float32), perfect) == pytest.approx(1.0, abs=1e-6)
    assert minilm.metric(emb, 1.0 - perfect) == pytest.approx(-1.0, abs=1e-12)
    noise = _unit(rng, 50, 384)
    assert abs(minilm.metric(noise, minilm.lee_similarities())) < 0.1
    # an evaluation limit of n documents: pairs among the first n only
    assert minilm.metric(emb[:10], perfect[:10]) == pytest.approx(1.0, abs=1e-12)
    assert minilm.metric(np.ones((5, 4)), perfect[:5]) == 0.0
    with pytest.raises(DataError, match="at least 3 documents"):
        minilm.metric(emb[:2], perfect[:2])


def test_mnist_model_trains_once_then_loads_from_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setenv("SLIMLINE_CACHE", str(tmp_path))
    torch.manual_seed(3)
    state = mnist.build().state_dict()
    calls = []

    def fake_train() -> Any:
        calls.append(1)
        return state

    monkeypatch.setattr(mnist, "train_model", fake_train)
    first = mnist.model()
    second = mnist.model()
    assert len(calls) == 1
    assert not first.training and not second.training
    for k, v in state.items():
        assert torch.equal(second.state_dict()[k], v)
    files = {p.name for p in (tmp_path / "examples").iterdir()}  # no temporary file left
    assert files == {mnist.weights_path().name, mnist.weights_path().with_suffix(".lock").name}
