"""Distillation's input views (compress/augment.py) and where distill applies them."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from slimline.compress import finetune
from slimline.compress.augment import augment_rows, augmentable
from slimline.compress.finetune import FinetuneConfig, distill


def _images(n: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 3, 6, 10)).astype(np.float32)}


def test_flip_mirrors_some_rows_exactly_and_leaves_the_rest() -> None:
    x = _images(64)["x"]
    out = augment_rows({"x": x}, ["flip"], step=3)["x"]
    mirrored = [bool(np.array_equal(o, r[..., ::-1])) for o, r in zip(out, x, strict=True)]
    same = [bool(np.array_equal(o, r)) for o, r in zip(out, x, strict=True)]
    assert all(m != s for m, s in zip(mirrored, same, strict=True))  # each row one or the other
    assert 16 < sum(mirrored) < 48  # about half
    assert np.array_equal(augment_rows({"x": x}, ["flip"], 3)["x"], out)  # seeded by the step
    assert not np.array_equal(augment_rows({"x": x}, ["flip"], 4)["x"], out)
    assert np.array_equal(x, _images(64)["x"])  # the caller's rows are not changed


def test_mixup_blends_each_row_with_another_row_of_the_batch() -> None:
    x = _images(6)["x"]
    out = augment_rows({"x": x}, ["mixup"], step=1)["x"]
    for i, o in enumerate(out):
        # o = lam * x[i] + (1 - lam) * x[j] for some other row j and lam in [0, 1]
        fits = []
        for j in range(len(x)):
            if j == i:
                continue
            d = (x[i] - x[j]).ravel()
            lam = float(np.dot((o - x[j]).ravel(), d) / np.dot(d, d))
            err = np.abs(lam * x[i] + (1 - lam) * x[j] - o).max()
            fits.append(-1e-5 <= lam <= 1 + 1e-5 and err < 1e-4)
        assert any(fits), i


def test_inputs_that_are_not_images_are_left_as_they_are() -> None:
    tokens = {"ids": np.ones((4, 7), np.int64)}
    assert not augmentable(tokens)
    assert augment_rows(tokens, ["flip", "mixup"], 1) is tokens
    mixed = {**_images(4), "size": np.ones((4, 2), np.float32)}  # a per-row second input
    assert augment_rows(mixed, ["mixup"], 1) is mixed
    assert augment_rows(_images(4), [], 1)["x"] is not None


def test_the_option_leaves_cache_keys_as_they_were_until_it_is_set() -> None:
    assert "augment" not in FinetuneConfig().key_dict()
    assert FinetuneConfig(augment=["mixup"]).key_dict()["augment"] == ["mixup"]
    with pytest.raises(ValueError):
        FinetuneConfig.model_validate({"augment": ["rotate"]})


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> Any:
        return self.c(x).mean(dim=(2, 3))


def _data(labels: bool) -> Any:
    rows = [_images(8, seed=s)["x"] for s in range(6)]

    def gen() -> Iterator[tuple[dict[str, np.ndarray], Any]]:
        for x in rows:
            yield {"x": x}, (np.zeros(len(x), np.int64) if labels else None)

    return gen


@pytest.mark.parametrize("labels", [False, True])
def test_distill_augments_unlabelled_batches_only(
    labels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    from slimline.compress import augment

    real = augment.augment_rows

    def spy(inputs: dict[str, np.ndarray], kinds: Any, step: int) -> dict[str, np.ndarray]:
        seen.append(step)
        return real(inputs, kinds, step)

    monkeypatch.setattr(finetune, "augment_rows", spy)
    torch.manual_seed(0)
    teacher = Conv().eval()
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        student.c.weight.add_(0.2 * torch.randn_like(student.c.weight))
    cfg = FinetuneConfig(
        steps=6,
        lr=1e-2,
        eval_every=3,
        patience=3,
        val_batches=2,
        progress=False,
        augment=["flip", "mixup"],
    )
    res = distill(student, teacher, _data(labels), cfg, output_kind="logits")
    assert res.steps == 6
    assert seen == ([] if labels else [1, 2, 3, 4, 5, 6])
