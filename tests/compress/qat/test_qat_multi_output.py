"""QAT of a model with several outputs (a detector's score and box heads): the ONNX graph
converts to a module returning all of them, the conversion check and the export check read every
output, the distillation loss weighs each output by its own scale, the declared judge reads them
all by name, and the QDQ export gives every output its source name back."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from slimline import api, load_task
from slimline.compress.distill_loss import distill_loss, outputs_loss
from slimline.compress.qat.held_out import DeclaredScore
from slimline.compress.qat.onnx_module import check_against_onnx, rename_outputs, to_torch
from slimline.compress.quant.config import QuantizeConfig
from slimline.errors import StepError
from slimline.measure.judge import Judge
from slimline.outputs import LogitsOutput
from slimline.recipe import recipe_from_dict

from .test_onnx_module import FALLBACK, _onnx_task, _rows, _short_qat, _tiny_cnn


def _two_heads() -> onnx.ModelProto:
    """The tiny CNN with a second output: its SE gate's logits, [n, 8, 1, 1]."""
    model = _tiny_cnn()
    model.graph.node.append(helper.make_node("Relu", ["gs"], ["z"]))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 8, 1, 1]))
    onnx.checker.check_model(model)
    return model


def _ort_all(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(sess.run(None, {"x": x}))


def test_a_two_output_graph_converts_to_a_module_returning_both() -> None:
    model = _two_heads()
    module = to_torch(model)
    x = _rows(3)
    with torch.no_grad():
        y, z = module(torch.from_numpy(x))
    want_y, want_z = _ort_all(model, x)
    np.testing.assert_allclose(y.numpy(), want_y, atol=1e-5)
    np.testing.assert_allclose(z.numpy(), want_z, atol=1e-5)
    check = check_against_onnx(
        module, lambda b: _ort_all(model, b["x"]), [{"x": x}], 8, 0.9999, ["y", "z"]
    )
    assert check["rows"] == 3 and check["rows_within"] == 3 and check["cosine_min"] > 0.9999


def test_a_disagreeing_second_output_is_named() -> None:
    model = _two_heads()

    def wrong(b: dict[str, np.ndarray]) -> list[np.ndarray]:
        y, z = _ort_all(model, b["x"])
        return [y, -z]

    with pytest.raises(StepError, match="on output 'z' on 2 of 2 rows"):
        check_against_onnx(to_torch(model), wrong, [{"x": _rows(2)}], 8, 0.9999, ["y", "z"])


def test_every_output_gets_its_source_name_back(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_two_heads(), str(path))
    rename_outputs(path, ["z", "y"])  # a swap: each name moves to the other output
    renamed = onnx.load(str(path))
    assert [o.name for o in renamed.graph.output] == ["z", "y"]
    got, want = _ort_all(renamed, _rows(1)), _ort_all(_two_heads(), _rows(1))
    np.testing.assert_allclose(got[0], want[0])
    with pytest.raises(StepError, match="has 2 outputs where the ONNX model has 1"):
        rename_outputs(path, ["y"])


def test_an_output_name_taken_by_an_inner_tensor_moves_the_inner_one(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_two_heads(), str(path))
    rename_outputs(path, ["cat", "z"])  # "cat" names an inner Concat's output
    renamed = onnx.load(str(path))
    assert [o.name for o in renamed.graph.output] == ["cat", "z"]
    np.testing.assert_allclose(_ort_all(renamed, _rows(2))[0], _ort_all(_two_heads(), _rows(2))[0])


class _Loss:
    temperature, alpha = 1.0, 0.5

    def __init__(self, embedding_loss: str) -> None:
        self.embedding_loss = embedding_loss


def test_one_output_is_distilled_as_before() -> None:
    s, t = torch.rand(4, 3), torch.rand(4, 3)
    for loss in ("mse", "cosine"):
        want = distill_loss(s, t, None, "other", _Loss(loss))
        assert float(outputs_loss(s, t, None, "other", _Loss(loss))) == float(want)
        assert float(outputs_loss((s,), (t,), None, "other", _Loss(loss))) == float(want)


def test_each_output_weighs_by_its_own_scale_under_mse() -> None:
    """A box head of raw values 1000x a score head's does not drown the score head: each MSE
    is relative to its teacher's mean square, and the loss is their mean."""
    gen = torch.Generator().manual_seed(0)
    score_t = torch.rand(4, 10, generator=gen)
    box_t = 1000.0 * torch.randn(4, 10, generator=gen)
    score_s, box_s = score_t + 0.1, box_t + 100.0  # the same relative error on both
    got = float(outputs_loss((score_s, box_s), (score_t, box_t), None, "other", _Loss("mse")))
    rel_score = 0.01 / float(score_t.pow(2).mean())
    rel_box = 1e4 / float(box_t.pow(2).mean())
    assert got == pytest.approx((rel_score + rel_box) / 2, rel=1e-5)
    # cosine is scale-free already: the mean of each output's
    cos = outputs_loss((score_s, box_s), (score_t, box_t), None, "other", _Loss("cosine"))
    each = [distill_loss(a, b, None, "other", _Loss("cosine")) for a, b in
            ((score_s, score_t), (box_s, box_t))]  # fmt: skip
    assert float(cos) == pytest.approx(float(sum(each)) / 2)


def test_the_declared_judge_reads_the_outputs_by_their_names() -> None:
    """A score whose first output is 'y' and second 'z' judges the declared 'z' (the second)."""
    judge = cast(Judge, Judge.from_declarations({"z": LogitsOutput()}))
    score = DeclaredScore(judge, "y", ("z",))
    y = np.zeros((2, 4))
    z = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert score.of_outputs([y, z], [y, z]) == 1.0
    assert score.of_outputs([y, z], [y, z[::-1]]) == 0.0


@pytest.mark.cpu_kinds
def test_fallback_qat_on_a_two_output_onnx_task_exports_both_outputs_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _short_qat(monkeypatch)
    doc = _onnx_task(tmp_path, _two_heads(), rows=24)
    task = load_task(doc["task"], doc["samples"])
    ctx = api.context_for(task, recipe_from_dict(doc), tmp_path / "w", timed=False)
    api.run_step(ctx, QuantizeConfig.model_validate(FALLBACK), ctx.baseline)
    (qat,) = [a for a in ctx.alternatives if a.step == "qat"]
    assert qat.meta["from_onnx"]["outputs"] == ["y", "z"]
    assert qat.meta["from_onnx"]["check"]["rows_within"] == qat.meta["from_onnx"]["check"]["rows"]
    artifact = onnx.load(str(qat.onnx))
    assert [o.name for o in artifact.graph.output] == ["y", "z"]
    assert any(n.op_type == "QuantizeLinear" for n in artifact.graph.node)
    # judged in the run on both outputs: the comparison row has the worst output's cosine
    row = qat.meta["comparison"]["rows"]["qat"]
    assert row["budget_ok"] is False and "cosine" in row["budget_reason"]


def test_a_multi_output_graph_is_judged_on_all_its_outputs_when_they_hold_the_declared() -> None:
    """The declared judge scores a converted graph with several outputs when every declared
    output is among them (a decoder may read them all); its loss stays the configured one."""
    from types import SimpleNamespace

    from slimline.compress.qat.step import QatConfig, _judged

    judge = cast(Judge, Judge.from_declarations({"z": LogitsOutput()}))
    ctx = cast(Any, SimpleNamespace(task=SimpleNamespace(judge=judge)))
    ft, score = _judged(QatConfig(), ctx, ["y", "z"])
    assert isinstance(score, DeclaredScore) and score.names == ("y", "z")
    assert ft.embedding_loss == QatConfig().finetune.embedding_loss
    assert _judged(QatConfig(), ctx, ["y", "w"])[1] is None  # 'z' is not an output of it
    assert _judged(QatConfig(judge_declared=False), ctx, ["y", "z"])[1] is None
