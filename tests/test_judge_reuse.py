"""The accept/reject verdict reads the quantize search's own interleaved rounds against FP32
where they are the same comparison (same baseline, the search's runtime, every planned round),
and times the pair afresh otherwise. Latencies are crafted: no verdict depends on this machine."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from slimline.candidate import Candidate
from slimline.measure.latency import summarize_latency
from slimline.pipeline import judge

ROUNDS = 5


def _lat(per_round: list[float]) -> dict[str, Any]:
    return summarize_latency([np.full(5, v) for v in per_round])


def _run() -> Any:
    base = Candidate("fp32-onnx", "fp32", None)
    return SimpleNamespace(
        runtimes=["onnxruntime", "openvino"],
        baseline=base,
        recipe=SimpleNamespace(
            bench=SimpleNamespace(rounds=ROUNDS), budget=SimpleNamespace(min_gain=0.03)
        ),
    )


def _cand(rounds: int = ROUNDS, against: str = "fp32-onnx") -> Candidate:
    c = Candidate("quantize", "quantize", "fp32-onnx")
    c.measurement = {
        "latency_ms": _lat([5.0] * rounds),
        "timed_with_baseline": {
            "against": against,
            "baseline_latency_ms": _lat([10.0] * rounds),
            "cpu_p50_ms": 9.0,
            "baseline_cpu_p50_ms": 18.0,
        },
    }
    return c


def test_the_verdict_reads_the_search_rounds_without_timing_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_timing(*a: Any, **k: Any) -> None:
        raise AssertionError("the pair was timed again")

    monkeypatch.setattr(judge, "compare", no_timing)
    run = _run()
    verdict, pair, lat, planned = judge._timed_verdict(run, run.baseline, _cand(), "onnxruntime")
    assert verdict == "faster" and pair["reused"] and pair["rounds"] == planned == ROUNDS
    assert lat["quantize"]["cpu_ms"]["p50"] == 9.0
    assert "(the quantize search's rounds)" in judge._pair_text(pair)


@pytest.mark.parametrize(
    ("runtime", "parent", "cand"),
    [
        ("openvino", "fp32-onnx", _cand()),  # the search timed on ONNX Runtime only
        ("onnxruntime", "graph", _cand(against="fp32-onnx")),  # another parent
        ("onnxruntime", "fp32-onnx", _cand(rounds=3)),  # fewer rounds than planned
        ("onnxruntime", "fp32-onnx", Candidate("quantize", "quantize", "fp32-onnx")),
    ],
)
def test_another_comparison_is_timed_afresh(runtime: str, parent: str, cand: Candidate) -> None:
    run = _run()
    par = run.baseline if parent == "fp32-onnx" else Candidate(parent, parent, "fp32-onnx")
    assert judge._search_rounds(run, par, cand, runtime) is None


def _conv_bn(path: Any, scale: float = 1.0) -> Any:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32) * scale, "w"),
        numpy_helper.from_array(np.ones(4, np.float32), "g"),
        numpy_helper.from_array(np.zeros(4, np.float32), "b"),
        numpy_helper.from_array(np.zeros(4, np.float32), "m"),
        numpy_helper.from_array(np.ones(4, np.float32), "v"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["n"]),
        helper.make_node("Relu", ["n"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_graph_step_that_onnx_runtime_would_apply_itself_is_not_timed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slimline.measure.runners import ort_session

    src = _conv_bn(tmp_path / "fp32.onnx")
    done = tmp_path / "graph.onnx"
    ort_session(src, 1, optimized_out=done, level="extended")  # what the graph step saves
    assert judge.executed_graph(src, 1) == judge.executed_graph(done, 1)
    other = _conv_bn(tmp_path / "other.onnx", scale=2.0)  # other weights: another graph
    assert judge.executed_graph(src, 1) != judge.executed_graph(other, 1)

    run = _run()
    run.threads = 1
    parent = Candidate("fp32-onnx", "fp32", None, onnx=src)
    cand = Candidate("graph", "graph", "fp32-onnx", onnx=done)
    why = judge._same_executed_graph(run, parent, cand, "onnxruntime")
    assert why is not None and "the same graph for both" in why
    assert judge._same_executed_graph(run, parent, cand, "openvino") is None  # not measured there
    changed = Candidate("graph", "graph", "fp32-onnx", onnx=other)
    assert judge._same_executed_graph(run, parent, changed, "onnxruntime") is None
