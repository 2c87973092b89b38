"""``finetune.output_losses``: a loss per output of a model with several (a detector's score
heads want binary cross-entropy, its box-distribution heads a KL divergence per group of bins),
named by output, checked against the model's outputs, and recorded by the QAT step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from slimline import api, load_task
from slimline.compress.distill_loss import distill_loss, losses_by_position, outputs_loss
from slimline.compress.finetune import FinetuneConfig, distill
from slimline.compress.qat.step import QatConfig
from slimline.compress.quant.config import QuantizeConfig
from slimline.errors import RecipeError
from slimline.recipe import recipe_from_dict

from .test_onnx_module import FALLBACK, _onnx_task
from .test_qat_multi_output import _two_heads


class _Loss:
    temperature, alpha, embedding_loss = 1.0, 0.5, "cosine"


def _kl_by_hand(s: np.ndarray, t: np.ndarray, bins: int) -> float:
    def log_softmax(a: np.ndarray) -> np.ndarray:
        a = a.reshape(-1, bins).astype(np.float64)
        a = a - a.max(axis=1, keepdims=True)
        return np.asarray(a - np.log(np.exp(a).sum(axis=1, keepdims=True)))

    ls, lt = log_softmax(s), log_softmax(t)
    return float((np.exp(lt) * (lt - ls)).sum(axis=1).mean())


def test_names_map_to_positions_and_a_wrong_name_or_loss_is_named() -> None:
    assert losses_by_position({}, None) == ()
    assert losses_by_position({"box": "kl:8", "score": "bce"}, ["score", "box", "aux"]) == (
        "bce",
        "kl:8",
        None,
    )
    with pytest.raises(RecipeError, match=r"\['boxes'\], not outputs.*\['score', 'box'\]"):
        losses_by_position({"boxes": "kl"}, ["score", "box"])
    with pytest.raises(RecipeError, match=r"'box': 'kl:0'.*one of cosine, mse, bce"):
        losses_by_position({"box": "kl:0"}, ["score", "box"])
    with pytest.raises(RecipeError, match="distilled on one output"):
        losses_by_position({"score": "bce"}, ["score"])


def test_kl_in_groups_of_bins_is_the_mean_kl_of_each_groups_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(2, 6, 16, generator=gen)  # 6 anchors, 4 sides x 4 bins
    s = t + 0.5 * torch.randn(2, 6, 16, generator=gen)
    cfg = _Loss()
    got = float(distill_loss(s, t, None, "other", cfg, None, "kl:4"))
    assert got == pytest.approx(_kl_by_hand(s.numpy(), t.numpy(), 4), rel=1e-5)
    whole = float(distill_loss(s, t, None, "other", cfg, None, "kl"))
    assert whole == pytest.approx(_kl_by_hand(s.numpy(), t.numpy(), 16), rel=1e-5)
    assert float(distill_loss(t, t, None, "other", cfg, None, "kl:4")) == pytest.approx(0, abs=1e-6)
    with pytest.raises(RecipeError, match=r"groups of 5.*shape is \[2, 6, 16\]"):
        distill_loss(s, t, None, "other", cfg, None, "kl:5")


def test_each_named_output_takes_its_own_loss_and_the_rest_keep_the_default() -> None:
    gen = torch.Generator().manual_seed(1)
    score_t = torch.rand(2, 5, 3, generator=gen)
    box_t = torch.randn(2, 5, 8, generator=gen)
    aux_t = torch.randn(2, 4, generator=gen)
    score_s = (score_t + 0.1).clamp(0, 1)
    box_s, aux_s = box_t * 1.5, aux_t * 2 + 0.1  # a shift would leave each softmax as it is
    cfg = _Loss()
    got = outputs_loss(
        (score_s, box_s, aux_s), (score_t, box_t, aux_t), None, "other", cfg, None,
        ("bce", "kl:4", None),
    )  # fmt: skip
    want = [
        distill_loss(score_s, score_t, None, "other", cfg, None, "bce"),
        distill_loss(box_s, box_t, None, "other", cfg, None, "kl:4"),
        distill_loss(aux_s, aux_t, None, "other", cfg),  # cosine, the embedding loss
    ]
    assert float(got) == pytest.approx(float(sum(want)) / 3, rel=1e-6)
    assert float(want[1]) == pytest.approx(_kl_by_hand(box_s.numpy(), box_t.numpy(), 4), rel=1e-5)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return torch.sigmoid(h[:, :3]), h[:, 4:]


def test_distill_reads_output_losses_by_the_outputs_names() -> None:
    torch.manual_seed(0)
    teacher, student = _TwoHeads(), _TwoHeads()
    rows = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    batches = [({"x": rows[i : i + 2]}, None) for i in range(0, 8, 2)]
    cfg = FinetuneConfig(
        steps=0, val_batches=1, min_val_rows=0, progress=False,
        output_losses={"score": "bce", "box": "kl:2"},
    )  # fmt: skip
    result = distill(
        student, teacher, lambda: iter(batches), cfg, output_kind="other",
        all_outputs=True, output_names=["score", "box"],
    )  # fmt: skip
    x = torch.from_numpy(rows[:2])
    with torch.no_grad():
        want = outputs_loss(student(x), teacher(x), None, "other", cfg, None, ("bce", "kl:2"))
    assert result.val_before == pytest.approx(float(want), rel=1e-6)
    with pytest.raises(RecipeError, match=r"\['boxes'\], not outputs"):
        distill(
            student, teacher, lambda: iter(batches),
            cfg.model_copy(update={"output_losses": {"boxes": "kl"}}), output_kind="other",
            all_outputs=True, output_names=["score", "box"],
        )  # fmt: skip
    with pytest.raises(RecipeError, match="distilled on one output"):
        distill(student, teacher, lambda: iter(batches), cfg, output_kind="other")


def test_an_empty_output_losses_leaves_the_cache_key_as_it_was() -> None:
    assert "output_losses" not in FinetuneConfig().key_dict()
    assert FinetuneConfig(output_losses={"y": "kl"}).key_dict()["output_losses"] == {"y": "kl"}


def test_qat_of_a_two_output_onnx_task_records_each_outputs_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import slimline.compress.qat.fallback as fallback

    short = QatConfig(
        finetune=FinetuneConfig(
            steps=2, eval_every=2, progress=False, output_losses={"z": "mse", "y": "kl"}
        ),
        calibration_samples=16,
        check_samples=4,
        progress=False,
    )
    monkeypatch.setattr(fallback, "QatConfig", lambda: short)
    doc = _onnx_task(tmp_path, _two_heads(), rows=24)
    task = load_task(doc["task"], doc["samples"])
    ctx = api.context_for(task, recipe_from_dict(doc), tmp_path / "w", timed=False)
    api.run_step(ctx, QuantizeConfig.model_validate(FALLBACK), ctx.baseline)
    (qat,) = [a for a in ctx.alternatives if a.step == "qat"]
    assert qat.meta["output_losses"] == {"z": "mse", "y": "kl"}
    assert qat.meta["finetune"]["steps"] == 2


def test_a_bad_loss_name_fails_when_the_recipe_loads() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"'y': 'kl:0'.*one of cosine, mse, bce"):
        FinetuneConfig(output_losses={"y": "kl:0"})
    assert FinetuneConfig(output_losses={"y": "kl:8"}).output_losses == {"y": "kl:8"}
