"""compress/qat/onnx_module.py: an ONNX CNN as a trainable torch.fx module (the same outputs as
ONNX Runtime, real Conv2d weights, fake quantization inserted), an op outside its set named, and
``quantize: {fallback: qat}`` on an ONNX task: QAT from the ONNX file, judged in the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from slimline import api, load_task
from slimline.compress.finetune import FinetuneConfig
from slimline.compress.qat import fakequant as fq
from slimline.compress.qat.onnx_module import check_against_onnx, rename_outputs, to_torch
from slimline.compress.qat.step import QatConfig
from slimline.compress.quant.config import QuantizeConfig
from slimline.errors import StepError
from slimline.recipe import recipe_from_dict
from slimline.steps import check_order, start_forms


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def _tiny_cnn(batch: int | str = "n", extra: list[onnx.NodeProto] | None = None) -> onnx.ModelProto:
    """Stem conv + BN + ReLU, a depthwise conv with hard-swish written as x * clip(x + 3, 0, 6)
    / 6, an SE gate (global pool, 1x1 conv, HardSigmoid), MaxPool, a YOLOX-style focus slice,
    upsampling by Resize and ConvTranspose, Concat, Sigmoid, then a Reshape (leading 1: the
    fixed batch) and Transpose head: opset 12, weights as Constant nodes and initializers."""
    rng = np.random.default_rng(0)

    def f(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.3, shape).astype(np.float32)

    def pos(n: int) -> np.ndarray:
        return rng.uniform(0.5, 1.5, n).astype(np.float32)

    nodes = [
        _const("w0", f(8, 3, 3, 3)), _const("b0", f(8)),
        _const("s", pos(8)), _const("sh", f(8)), _const("m", f(8)), _const("v", pos(8)),
        _const("wd", f(8, 1, 3, 3)), _const("three", np.array(3.0, np.float32)),
        _const("zero", np.array(0.0, np.float32)), _const("six", np.array(6.0, np.float32)),
        _const("ws", f(8, 8, 1, 1)), _const("roi", np.zeros(0, np.float32)),
        _const("scales", np.array([1, 1, 2, 2], np.float32)), _const("wt", f(8, 4, 2, 2)),
        _const("wh", f(2, 12, 1, 1)), _const("st", np.array([0], np.int64)),
        _const("en", np.array([2**63 - 1], np.int64)), _const("ax", np.array([2], np.int64)),
        _const("two", np.array([2], np.int64)),
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("BatchNormalization", ["c0", "s", "sh", "m", "v"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("Conv", ["r", "wd"], ["dw"], group=8, pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["dw", "three"], ["d3"]),
        helper.make_node("Clip", ["d3", "zero", "six"], ["cl"]),
        helper.make_node("Mul", ["dw", "cl"], ["hm"]),
        helper.make_node("Div", ["hm", "six"], ["hs"]),
        helper.make_node("GlobalAveragePool", ["hs"], ["g"]),
        helper.make_node("Conv", ["g", "ws"], ["gs"]),
        helper.make_node("HardSigmoid", ["gs"], ["gate"], alpha=0.2, beta=0.5),
        helper.make_node("Mul", ["hs", "gate"], ["se"]),
        helper.make_node("MaxPool", ["se"], ["mp"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Slice", ["mp", "st", "en", "ax", "two"], ["sl"]),  # rows 0, 2, 4...
        helper.make_node("Resize", ["sl", "roi", "scales"], ["up"], mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
        helper.make_node("ConvTranspose", ["mp", "wt"], ["upt"], strides=[2, 2]),
        helper.make_node("Slice", ["upt", "st", "en", "ax", "two"], ["upts"]),
        helper.make_node("Concat", ["up", "upts"], ["cat"], axis=1),
        helper.make_node("Conv", ["cat", "wh"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["prob"]),
        helper.make_node("Reshape", ["prob", "shape"], ["flat"]),
        helper.make_node("Transpose", ["flat"], ["y"], perm=[0, 2, 1]),
        *(extra or []),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "tiny_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 16, 16])],
        [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, [batch, 128, 2])],
        [numpy_helper.from_array(np.array([1 if batch == 1 else 0, 2, -1], np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out: np.ndarray = sess.run(None, {"x": x})[0]
    return out


def _rows(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, (n, 3, 16, 16)).astype(np.float32)


def test_the_converted_module_computes_what_onnx_runtime_computes() -> None:
    model = _tiny_cnn()
    module = to_torch(model)
    x = _rows(3)
    with torch.no_grad():
        got = module(torch.from_numpy(x)).numpy()
    want = _ort(model, x)
    assert got.shape == want.shape == (3, 128, 2)
    np.testing.assert_allclose(got, want, atol=1e-5)
    convs = [m for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 4 and convs[1].groups == 8  # the depthwise one
    assert all(p.requires_grad for p in module.parameters())  # trainable
    check = check_against_onnx(module, lambda b: [_ort(model, b["x"])], [{"x": x}], 8, 0.9999)
    assert check["rows"] == 3 and check["cosine_min"] > 0.9999


def test_a_fixed_batch_of_one_trains_on_several_rows() -> None:
    """The Reshape [1, 2, -1] of a model whose batch is fixed at 1 keeps the rows' axis."""
    model = _tiny_cnn(batch=1)
    module = to_torch(model, free_batch=True)
    x = _rows(3)
    with torch.no_grad():
        got = module(torch.from_numpy(x)).numpy()
    want = np.concatenate([_ort(model, x[i : i + 1]) for i in range(3)])
    np.testing.assert_allclose(got, want, atol=1e-5)
    with torch.no_grad():  # as the ONNX file says, without free_batch: the rows run together
        assert to_torch(model)(torch.from_numpy(x)).shape == (1, 3 * 128, 2)


def test_a_classifier_head_reshaped_to_a_computed_shape() -> None:
    """PP-OCR's classifier head: Reshape(x, Concat(Cast(Slice(Shape(x), 0, 1)), [-1])), MatMul
    with a constant, Softmax over the last axis of opset 11 (the rank carried past the Reshape)."""
    w = np.random.default_rng(2).normal(0, 0.3, (8, 5)).astype(np.float32)
    nodes = [
        _const("s0", np.array([0], np.int64)), _const("s1", np.array([1], np.int64)),
        _const("rest", np.array([-1], np.int64)), _const("w", w),
        helper.make_node("GlobalAveragePool", ["x"], ["g"]),
        helper.make_node("Shape", ["g"], ["shape"]),
        helper.make_node("Cast", ["shape"], ["shape_i"], to=TensorProto.INT32),
        helper.make_node("Slice", ["shape_i", "s0", "s1", "s0", "s1"], ["rows"]),
        helper.make_node("Cast", ["rows"], ["rows_l"], to=TensorProto.INT64),
        helper.make_node("Concat", ["rows_l", "rest"], ["target"], axis=-1),
        helper.make_node("Reshape", ["g", "target"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["y"], axis=1),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 7
    x = np.random.default_rng(3).normal(0, 1, (3, 8, 4, 4)).astype(np.float32)
    with torch.no_grad():
        got = to_torch(model)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, _ort(model, x), atol=1e-6)


def test_qat_inserts_fake_quantization_into_the_converted_module() -> None:
    module = to_torch(_tiny_cnn())
    student = fq.prepare(module, {"x": torch.zeros(2, 3, 16, 16)}, fq.FakeQuantFormat())
    weights = [n for n, m in fq.fake_quant_modules(student).items() if fq._is_weight(m)]
    assert len(weights) == 4  # every Conv2d, the depthwise one included
    student(torch.zeros(2, 3, 16, 16)).sum().backward()  # gradients flow through it


def test_an_op_outside_the_set_is_named() -> None:
    model = _tiny_cnn(extra=[helper.make_node("Erf", ["y"], ["e"], name="erf_1")])
    with pytest.raises(StepError, match=r"unsupported ONNX op Erf \(node erf_1\)"):
        to_torch(model)


def test_an_attribute_it_cannot_reproduce_is_named() -> None:
    model = _tiny_cnn()
    resize = next(n for n in model.graph.node if n.op_type == "Resize")
    attr = next(a for a in resize.attribute if a.name == "coordinate_transformation_mode")
    attr.s = b"half_pixel"
    with pytest.raises(StepError, match=r"ONNX op Resize .* mode nearest with half_pixel"):
        to_torch(model)


def test_a_disagreeing_conversion_is_rejected() -> None:
    model = _tiny_cnn()
    x = _rows(2)
    with pytest.raises(StepError, match="disagrees with ONNX Runtime on 2 of 2 rows"):
        check_against_onnx(to_torch(model), lambda b: [-_ort(model, b["x"])], [{"x": x}], 8, 0.9999)


def test_the_export_gets_the_source_output_name(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_tiny_cnn(), str(path))
    rename_outputs(path, ["probabilities"])
    renamed = onnx.load(str(path))
    assert renamed.graph.output[0].name == "probabilities"
    np.testing.assert_allclose(_ort(renamed, _rows(1)), _ort(_tiny_cnn(), _rows(1)))


def test_qat_runs_on_an_onnx_task_in_recipe_order() -> None:
    assert check_order([QatConfig()], start_forms(onnx_task=True)) is None


def _onnx_task(tmp_path: Path, model: onnx.ModelProto, rows: int = 24) -> dict[str, Any]:
    path, samples = tmp_path / "m.onnx", tmp_path / "s.npz"
    onnx.save(model, str(path))
    np.savez(samples, x=_rows(rows))
    return {
        "name": "tiny-onnx",
        "task": str(path),
        "samples": str(samples),
        "target": {"threads": 1},
        "budget": {"max_metric_drop": 1.0, "min_cosine": 0.999999},  # no INT8 model meets it
        "bench": {"rounds": 2, "runs_per_round": 100, "warmup": 1, "batch_sizes": [1],
                  "throughput_min_seconds": 0.01, "peak_rss": False},
    }  # fmt: skip


def _short_qat(monkeypatch: pytest.MonkeyPatch) -> None:
    import slimline.compress.qat.fallback as fallback

    short = QatConfig(
        finetune=FinetuneConfig(steps=2, eval_every=2, progress=False),
        calibration_samples=16,
        check_samples=4,
        progress=False,
    )
    monkeypatch.setattr(fallback, "QatConfig", lambda: short)


FALLBACK = {"mode": "static", "fallback": "qat", "mixed_precision": False}


def _fallback(tmp_path: Path, model: onnx.ModelProto, rows: int) -> tuple[Any, Any]:
    """The quantize step with ``fallback: qat`` on an ONNX task: (its output, its context)."""
    doc = _onnx_task(tmp_path, model, rows)
    task = load_task(doc["task"], doc["samples"])
    ctx = api.context_for(task, recipe_from_dict(doc), tmp_path / "w", timed=False)
    return api.run_step(ctx, QuantizeConfig.model_validate(FALLBACK), ctx.baseline), ctx


@pytest.mark.cpu_kinds
def test_fallback_qat_on_an_onnx_task_gives_a_qdq_candidate_judged_on_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _short_qat(monkeypatch)
    out, ctx = _fallback(tmp_path, _tiny_cnn(), rows=24)
    assert out.step == "quantize" and "QAT missed the budget too" in out.meta["qat_fallback"]
    (qat,) = [a for a in ctx.alternatives if a.step == "qat"]
    assert "missed the budget" in qat.meta["fallback_from"]["why"]
    assert qat.meta["from_onnx"]["output"] == "y"
    assert qat.meta["from_onnx"]["check"]["cosine_min"] >= 0.9999
    assert qat.meta["export_check"]["int8_weights"] >= 3
    row = qat.meta["comparison"]["rows"]["qat"]
    assert row["budget_ok"] is False and "cosine" in row["budget_reason"]  # judged on the budget
    assert qat.accepted is False and qat.reason == f"QAT fallback: {row['budget_reason']}"
    artifact = onnx.load(str(qat.onnx))
    assert [o.name for o in artifact.graph.output] == ["y"]  # as the task's declarations name it
    assert any(n.op_type == "QuantizeLinear" for n in artifact.graph.node)


def test_an_onnx_task_qat_cannot_convert_is_rejected_and_ptq_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _short_qat(monkeypatch)
    model = _tiny_cnn(extra=[helper.make_node("Erf", ["y"], ["e"], name="erf_1")])
    out, ctx = _fallback(tmp_path, model, rows=8)
    assert (
        out.step == "quantize" and "QAT failed: unsupported ONNX op Erf" in out.meta["qat_fallback"]
    )
    (qat,) = [a for a in ctx.alternatives if a.step == "qat"]
    assert qat.accepted is False and "unsupported ONNX op Erf (node erf_1)" in qat.reason


@pytest.mark.parametrize(("opset", "sizes"), [(11, [3, 5]), (13, [3, 5]), (13, None)])
def test_split_gives_each_part_to_its_output(opset: int, sizes: list[int] | None) -> None:
    """Split by sizes (an attribute before opset 13, an input from 13) or into equal parts, its
    outputs read on (PP-PicoDet splits each head into scores and box distributions)."""
    inputs: list[str] = ["x"]
    attrs: dict[str, Any] = {"axis": 1}
    nodes = []
    if sizes is not None and opset >= 13:
        nodes.append(_const("sizes", np.array(sizes, np.int64)))
        inputs.append("sizes")
    elif sizes is not None:
        attrs["split"] = sizes
    nodes += [
        helper.make_node("Split", inputs, ["a", "b"], **attrs),
        helper.make_node("Sigmoid", ["a"], ["sa"]),
        helper.make_node("Relu", ["b"], ["rb"]),
    ]
    graph = helper.make_graph(
        nodes,
        "split",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 4, 4])],
        [
            helper.make_tensor_value_info("sa", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("rb", TensorProto.FLOAT, None),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    x = np.random.default_rng(4).normal(0, 1, (2, 8, 4, 4)).astype(np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})
    with torch.no_grad():
        got = to_torch(model)(torch.from_numpy(x))
    assert [g.shape[1] for g in got] == [w.shape[1] for w in want] == (sizes or [4, 4])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w, atol=1e-6)
