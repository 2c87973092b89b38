"""Mixed precision by measured output impact: the node whose own rounding looks worst is not
always the one the output pays for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slimline.compress.quant.config import QuantSpec
from slimline.compress.quant.engine import quantize_model
from slimline.compress.quant.impact import (
    EMBEDDINGS,
    Impact,
    node_costs,
    output_impact,
    rank_by_impact,
)
from slimline.compress.quant.layerwise import layer_errors
from slimline.cpu import detect
from slimline.measure.quality import fidelity
from slimline.measure.runners import ort_session

pytestmark = pytest.mark.cpu_kinds  # INT8 kernels: also run under the AVX2 lane


def _damped_graph(path: Path) -> None:
    """out = X @ Wb + 0.001 * (Y @ Wa). Y has one outlier column, so ``damped``'s dynamically
    quantized input loses most of its bits (the worst local error), but its output is scaled
    down a thousand times; ``direct``'s smaller error reaches the output whole."""
    rng = np.random.default_rng(0)
    wa = numpy_helper.from_array(rng.normal(size=(16, 16)).astype(np.float32), "Wa")
    wb = numpy_helper.from_array(rng.normal(size=(16, 16)).astype(np.float32), "Wb")
    k = numpy_helper.from_array(np.array(0.001, np.float32), "k")
    nodes = [
        helper.make_node("MatMul", ["Y", "Wa"], ["a"], name="damped"),
        helper.make_node("Mul", ["a", "k"], ["a2"], name="scale"),
        helper.make_node("MatMul", ["X", "Wb"], ["b"], name="direct"),
        helper.make_node("Add", ["b", "a2"], ["out"], name="sum"),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 16]) for n in ("X", "Y")]
    out = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 16])]
    graph = helper.make_graph(nodes, "damped", io, out, [wa, wb, k])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))


def _batches(n: int = 4, rows: int = 8) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        y = rng.normal(size=(rows, 16)).astype(np.float32)
        y[:, 0] = 500.0
        out.append({"X": rng.normal(size=(rows, 16)).astype(np.float32), "Y": y})
    return out


def _cosine_to(src: Path) -> Callable[[Path], float]:
    """Mean cosine of a model's output to ``src``'s on :func:`_batches`."""
    ref = np.concatenate([ort_session(src, 1).run(None, b)[0] for b in _batches()])

    def score(path: Path) -> float:
        got = np.concatenate([ort_session(path, 1).run(None, b)[0] for b in _batches()])
        return float(fidelity(got, ref, logits=False)["cosine_mean"] or 0.0)

    return score


def test_the_output_gain_ranks_the_node_the_layerwise_error_ranks_last(tmp_path: Path) -> None:
    src, q = tmp_path / "f.onnx", tmp_path / "q.onnx"
    _damped_graph(src)
    # the CPU's own weights: 8-bit U8S8 weights saturate in 16 bits without VNNI, and that
    # saturation, not the rounding this test is about, would then rank the nodes
    spec = QuantSpec("dynamic", reduce_range=detect().u8s8_saturates)
    quantize_model(src, q, spec, [])
    local = layer_errors(src, q, ["damped", "direct"], _batches(), 16)
    assert [r["node"] for r in local] == ["damped", "direct"]  # the local view blames damped

    impacts = output_impact(src, spec, [], ["damped", "direct"], _cosine_to(src), {})
    gain = {i.node: i.gain for i in impacts}
    assert gain["direct"] > 10 * max(gain["damped"], 1e-9)
    assert rank_by_impact(["damped", "direct"], impacts) == ["direct", "damped"]


def test_rank_by_impact_prices_gain_by_cost_and_puts_useless_nodes_last() -> None:
    impacts = [
        Impact("big", 0.99, 0.004, 1.0),  # 0.004 per unit
        Impact("cheap", 0.99, 0.002, 0.1),  # 0.02 per unit: first
        Impact("noop", 0.98, -0.001, 0.1),
    ]
    order = rank_by_impact(["noop", "big", "unmeasured", "cheap"], impacts)
    assert order == ["cheap", "big", "unmeasured", "noop"]


def test_node_costs_weigh_a_convolution_by_its_output_positions(tmp_path: Path) -> None:
    w1 = numpy_helper.from_array(np.zeros((8, 3, 3, 3), np.float32), "w1")
    w2 = numpy_helper.from_array(np.zeros((8, 8, 3, 3), np.float32), "w2")
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["h"], name="wide", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["h", "w2"], ["y"], name="strided", strides=[4, 4]),
    ]
    graph = helper.make_graph(
        nodes,
        "c",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    lat = node_costs(model, ["wide", "strided", EMBEDDINGS], "latency")
    # wide: 216 weights x 32*32 positions; strided: 576 weights x 8*8 positions (1/6 of it)
    assert lat["wide"] == 1.0 and 0.0 < lat["strided"] < 0.3
    assert lat[EMBEDDINGS] == 1e-3  # no table: the floor
    size = node_costs(model, ["wide", "strided"], "size")
    assert size["strided"] == 1.0 and abs(size["wide"] - 216 / 576) < 1e-9
