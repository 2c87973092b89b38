"""Layer-wise error: SQNR and cosine of every compute node's output, quantized vs float.

Both graphs are run on the same samples with the nodes' outputs exposed. The error of a node's
output includes what reached it from upstream, so each row also says how much the node *adds*
(its SQNR drop from the nearest measured tensor upstream); the ranking uses that.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...measure.runners import ort_session
from ...task import Inputs
from .calibrate import rebatch
from .prepare import COMPUTE_OPS

__all__ = ["error_statement", "layer_errors"]

_PASS_THROUGH = ("Relu", "Clip", "LeakyRelu")  # activations the quantizer folds into their producer


def _tensor_for(
    node: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]], available: set[str]
) -> str | None:
    t = node.output[0]
    for _ in range(3):
        if t in available:
            return t
        nxt = consumers.get(t, [])
        if len(nxt) != 1 or nxt[0].op_type not in _PASS_THROUGH:
            return None
        t = nxt[0].output[0]
    return t if t in available else None


def _dequantized(t: str, qgraph: onnx.GraphProto) -> str:
    """In a QDQ graph, the value consumers see: ``t -> QuantizeLinear -> DequantizeLinear``.

    (For an activation folded into its producer, ``t`` itself is the unclipped value.)"""
    q = next((n for n in qgraph.node if n.op_type == "QuantizeLinear" and n.input[0] == t), None)
    if q is None:
        return t
    d = next(
        (n for n in qgraph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0]),
        None,
    )
    return d.output[0] if d is not None else t


def _expose(model: onnx.ModelProto, tensors: list[str], path: Path) -> None:
    existing = {o.name for o in model.graph.output}
    for t in tensors:
        if t not in existing:
            model.graph.output.append(helper.make_tensor_value_info(t, TensorProto.FLOAT, None))
    onnx.save(model, str(path))


def _upstream(graph: onnx.GraphProto, measured: dict[str, str]) -> dict[str, list[str]]:
    """For each measured node, the measured tensors nearest upstream of its activation inputs."""
    producers = {o: n for n in graph.node for o in n.output}
    inits = {i.name for i in graph.initializer}
    measured_tensors = set(measured.values())
    out: dict[str, list[str]] = {}
    nodes = {n.name: n for n in graph.node}
    for name in measured:
        found: set[str] = set()
        stack = [i for i in nodes[name].input if i and i not in inits]
        seen: set[str] = set()
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            if t in measured_tensors:
                found.add(t)
                continue
            p = producers.get(t)
            if p is not None:
                stack.extend(i for i in p.input if i and i not in inits)
        out[name] = sorted(found)
    return out


def layer_errors(
    float_path: Path,
    quant_path: Path,
    nodes: list[str],
    batches: Iterable[Inputs],
    samples: int,
    threads: int = 1,
) -> list[dict[str, Any]]:
    """Rows {node, op_type, tensor, sqnr_db, cosine, sqnr_drop_db, added_nsr}, worst first.

    The ranking is by the noise-to-signal power a node adds to what reached it."""
    fmodel = onnx.load(str(float_path))
    qmodel = onnx.load(str(quant_path))
    available = {o for n in qmodel.graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in fmodel.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    by_name = {n.name: n for n in fmodel.graph.node}
    measured = {
        name: t
        for name in nodes
        if name in by_name
        and by_name[name].op_type in COMPUTE_OPS
        and (t := _tensor_for(by_name[name], consumers, available)) is not None
    }
    tensors = sorted(set(measured.values()))
    if not tensors:
        return []
    qtensors = [_dequantized(t, qmodel.graph) for t in tensors]
    acc = _run_both(fmodel, qmodel, tensors, qtensors, batches, samples, threads)
    ups = _upstream(fmodel.graph, measured)
    rows = [
        _row(name, by_name[name].op_type, t, acc[t], [acc[u] for u in ups[name]])
        for name, t in measured.items()
    ]
    return sorted(rows, key=lambda r: -r["rank_score"])


def _run_both(
    fmodel: onnx.ModelProto,
    qmodel: onnx.ModelProto,
    tensors: list[str],
    qtensors: list[str],
    batches: Iterable[Inputs],
    samples: int,
    threads: int,
) -> dict[str, np.ndarray]:
    with tempfile.TemporaryDirectory() as tmp:
        fp, qp = Path(tmp) / "f.onnx", Path(tmp) / "q.onnx"
        _expose(fmodel, tensors, fp)
        _expose(qmodel, qtensors, qp)
        fs, qs = ort_session(fp, threads), ort_session(qp, threads)
        acc = {t: np.zeros(4) for t in tensors}  # sum ref^2, sum err^2, dot, sum q^2
        for row in rebatch(batches, 1, samples):
            for t, a, b in zip(tensors, fs.run(tensors, row), qs.run(qtensors, row), strict=True):
                a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
                d = a64 - b64
                acc[t] += (a64 @ a64, d @ d, a64 @ b64, b64 @ b64)
    return acc


def _sqnr(a: np.ndarray) -> float:
    ref, err = a[0], a[1]
    if err <= 0:
        return math.inf
    return 10.0 * math.log10(max(ref, 1e-30) / err)


def _row(
    name: str, op: str, tensor: str, acc: np.ndarray, upstream: list[np.ndarray]
) -> dict[str, Any]:
    sqnr = _sqnr(acc)
    cos = float(acc[2] / math.sqrt(max(acc[0] * acc[3], 1e-30)))
    up = min((_sqnr(u) for u in upstream), default=math.inf)
    # noise-to-signal power added by this node: what it adds on top of what reached it
    added_nsr = max(10 ** (-sqnr / 10) - 10 ** (-up / 10), 0.0)
    drop = None if math.isinf(up) or math.isinf(sqnr) else round(up - sqnr, 3)
    return {
        "node": name,
        "op_type": op,
        "tensor": tensor,
        "sqnr_db": None if math.isinf(sqnr) else round(sqnr, 3),
        "cosine": round(cos, 6),
        "upstream_sqnr_db": None if math.isinf(up) else round(up, 3),
        "sqnr_drop_db": drop,
        "added_nsr": added_nsr,
        "rank_score": added_nsr,
    }


def error_statement(rows: list[dict[str, Any]]) -> str:
    """One sentence on where the error concentrates."""
    rows = [r for r in rows if r["sqnr_db"] is not None]
    if not rows:
        return "no quantized node could be compared with its float counterpart"
    total = sum(r["added_nsr"] for r in rows) or 1.0
    top = rows[0]
    top3 = sum(r["added_nsr"] for r in rows[:3]) / total
    worst = min(rows, key=lambda r: r["sqnr_db"])
    return (
        f"error concentrates in {top['node']} ({top['op_type']}): it adds {top['added_nsr'] / total:.0%} "
        f"of the quantization noise (output SQNR {top['sqnr_db']:.1f} dB); the top 3 nodes add "
        f"{top3:.0%}; the lowest output SQNR is {worst['sqnr_db']:.1f} dB at {worst['node']} "
        f"({worst['op_type']})"
    )
