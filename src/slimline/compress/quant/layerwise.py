"""Layer-wise error of a quantized graph against its float source.

For every quantized compute node, two figures on the same samples:

* **output SQNR / cosine**: the node's output in the quantized graph against the float graph,
  with everything upstream quantized too (what the issue calls the node's error: it accumulates);
* **local SQNR**: the node's own quantization alone: the quantized graph's piece for that node
  (input Q/DQ, INT8 weights, integer op, output Q/DQ) run on the *float* graph's inputs to it.

The ranking (and so mixed precision) uses the local SQNR: it says which node to keep in float,
where the accumulated figure would blame every node downstream of the first bad one.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...measure.runners import ort_session
from ...signature import Signature
from ...task import Inputs
from .calibrate import rebatch
from .prepare import COMPUTE_OPS

__all__ = ["error_statement", "layer_errors"]

_PASS_THROUGH = ("Relu", "Clip", "LeakyRelu")  # activations the quantizer folds into their producer


@dataclass
class _Probe:
    node: str
    op_type: str
    f_out: str  # float graph: the node's output (after a folded activation)
    q_out: str  # quantized graph: the value consumers see
    f_in: str  # float graph: the node's activation input
    q_in: str  # quantized graph: the raw value its input Q/DQ starts from
    local: Any = None  # session of the node's piece of the quantized graph


class _Graph:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        g = model.graph
        self.producer = {o: n for n in g.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.by_name = {n.name: n for n in g.node}
        self.inits = {i.name: i for i in g.initializer}
        self.inputs = [i.name for i in g.input if i.name not in self.inits]
        self.input_info = {i.name: i for i in g.input}
        self.outputs = {o.name for o in g.output}
        self.tensors = set(self.producer) | set(self.inputs)

    def dequantized(self, t: str) -> str:
        """``t -> QuantizeLinear -> DequantizeLinear``: the value consumers see (else ``t``)."""
        q = next((n for n in self.consumers.get(t, []) if n.op_type == "QuantizeLinear"), None)
        if q is None:
            return t
        d = next(
            (n for n in self.consumers.get(q.output[0], []) if n.op_type == "DequantizeLinear"),
            None,
        )
        return d.output[0] if d is not None else t

    def raw(self, t: str) -> str:
        """Undo a DequantizeLinear <- QuantizeLinear pair: the float value that was quantized."""
        d = self.producer.get(t)
        if d is None or d.op_type != "DequantizeLinear":
            return t
        q = self.producer.get(d.input[0])
        return q.input[0] if q is not None and q.op_type == "QuantizeLinear" else t

    def piece(self, inputs: list[str], output: str) -> onnx.ModelProto | None:
        """The nodes computing ``output`` from ``inputs`` and initializers, as a model."""
        stop, seen, stack = set(inputs), set(), [output]
        needed: list[onnx.NodeProto] = []
        while stack:
            t = stack.pop()
            if not t or t in seen or t in stop or t in self.inits:
                continue
            seen.add(t)
            node = self.producer.get(t)
            if node is None:
                return None
            if all(n is not node for n in needed):
                needed.append(node)
                stack.extend(node.input)
        order = {n.name + "|" + n.output[0]: i for i, n in enumerate(self.model.graph.node)}
        needed.sort(key=lambda n: order[n.name + "|" + n.output[0]])
        needed = [self._without_outputs(n, stop) for n in needed]
        used = {i for n in needed for i in n.input}
        graph = helper.make_graph(
            needed,
            "piece",
            [
                self.input_info.get(i) or helper.make_tensor_value_info(i, TensorProto.FLOAT, None)
                for i in inputs
                if i in used
            ],
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
            [self.inits[i] for i in sorted(used) if i in self.inits],
        )
        return helper.make_model(
            graph, opset_imports=list(self.model.opset_import), ir_version=self.model.ir_version
        )

    @staticmethod
    def _without_outputs(node: onnx.NodeProto, names: set[str]) -> onnx.NodeProto:
        """A copy of ``node`` whose outputs in ``names`` (fed from outside) are renamed away."""
        if not names.intersection(node.output):
            return node
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for i, o in enumerate(copy.output):
            if o in names:
                copy.output[i] = f"{o}__unused"
        return copy


def _output_of(node: onnx.NodeProto, f: _Graph, q: _Graph) -> str | None:
    t = node.output[0]
    for _ in range(3):
        if t in q.tensors:
            return str(t)
        nxt = f.consumers.get(t, [])
        if len(nxt) != 1 or nxt[0].op_type not in _PASS_THROUGH:
            return None
        t = nxt[0].output[0]
    return t if t in q.tensors else None


def _probes(f: _Graph, q: _Graph, nodes: list[str]) -> list[_Probe]:
    probes = []
    for name in nodes:
        node = f.by_name.get(name)
        if node is None or node.op_type not in COMPUTE_OPS:
            continue
        out = _output_of(node, f, q)
        x = next((i for i in node.input if i and i not in f.inits), None)
        if out is None or x is None:
            continue
        qnode = q.by_name.get(name)
        q_in = q.raw(qnode.input[0]) if qnode is not None and qnode.input else x
        if q_in not in q.tensors:
            continue
        probes.append(_Probe(name, node.op_type, out, q.dequantized(out), x, q_in))
    return probes


def _expose(model: onnx.ModelProto, tensors: list[str], path: Path) -> None:
    existing = {o.name for o in model.graph.output}
    for t in dict.fromkeys(tensors):
        if t not in existing:
            model.graph.output.append(helper.make_tensor_value_info(t, TensorProto.FLOAT, None))
    onnx.save(model, str(path))


def _stats(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    a, b = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    d = a - b
    # elementwise sums, not BLAS dot products: BLAS threads spin against ONNX Runtime's
    return np.array([(a * a).sum(), (d * d).sum(), (a * b).sum(), (b * b).sum()])


def layer_errors(
    float_path: Path,
    quant_path: Path,
    nodes: list[str],
    batches: Iterable[Inputs],
    samples: int,
    threads: int = 1,
    signature: Signature | None = None,
) -> list[dict[str, Any]]:
    """Rows {node, op_type, sqnr_db, cosine, local_sqnr_db, local_cosine}, worst local first.
    ``signature`` says where each input's batch axis is (rows are fed one at a time)."""
    f, q = _Graph(onnx.load(str(float_path))), _Graph(onnx.load(str(quant_path)))
    probes = _probes(f, q, nodes)
    if not probes:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        fp, qp = Path(tmp) / "f.onnx", Path(tmp) / "q.onnx"
        f_names = list(dict.fromkeys([p.f_out for p in probes] + [p.f_in for p in probes]))
        q_names = list(dict.fromkeys(p.q_out for p in probes))
        _expose(f.model, f_names, fp)
        _expose(q.model, q_names, qp)
        fs, qs = ort_session(fp, threads), ort_session(qp, threads)
        for i, p in enumerate(probes):
            piece = q.piece(list(dict.fromkeys([p.q_in, *q.inputs])), p.q_out)
            if piece is not None:
                path = Path(tmp) / f"piece{i}.onnx"
                onnx.save(piece, str(path))
                p.local = ort_session(path, threads, level="basic")
        acc = {p.node: np.zeros(4) for p in probes}
        local = {p.node: np.zeros(4) for p in probes}
        for row in rebatch(batches, 1, samples, signature):
            fo = dict(zip(f_names, fs.run(f_names, row), strict=True))
            qo = dict(zip(q_names, qs.run(q_names, row), strict=True))
            for p in probes:
                acc[p.node] += _stats(fo[p.f_out], qo[p.q_out])
                if p.local is not None:
                    feed = {
                        i.name: (fo[p.f_in] if i.name == p.q_in else row[i.name])
                        for i in p.local.get_inputs()
                    }
                    local[p.node] += _stats(fo[p.f_out], p.local.run(None, feed)[0])
    rows = [_row(p, acc[p.node], local[p.node] if p.local is not None else None) for p in probes]
    return sorted(rows, key=lambda r: -r["rank_score"])


def _sqnr(a: np.ndarray) -> float:
    if a[1] <= 0:
        return math.inf
    return 10.0 * math.log10(max(a[0], 1e-30) / a[1])


def _cos(a: np.ndarray) -> float:
    return float(a[2] / math.sqrt(max(a[0] * a[3], 1e-30)))


def _db(x: float) -> float | None:
    return None if math.isinf(x) else round(x, 3)


def _row(p: _Probe, acc: np.ndarray, local: np.ndarray | None) -> dict[str, Any]:
    sqnr = _sqnr(acc)
    own = _sqnr(local) if local is not None else sqnr
    return {
        "node": p.node,
        "op_type": p.op_type,
        "tensor": p.f_out,
        "sqnr_db": _db(sqnr),
        "cosine": round(_cos(acc), 6),
        "local_sqnr_db": _db(own),
        "local_cosine": round(_cos(local), 6) if local is not None else None,
        "rank_score": 10 ** (-own / 10),  # the node's own noise-to-signal power
    }


def error_statement(rows: list[dict[str, Any]]) -> str:
    """One sentence on where the error concentrates."""
    rows = [r for r in rows if r["local_sqnr_db"] is not None]
    if not rows:
        return "no quantized node could be compared with its float counterpart"
    total = sum(r["rank_score"] for r in rows) or 1.0
    top = rows[0]
    top3 = sum(r["rank_score"] for r in rows[:3]) / total
    worst = min(
        (r for r in rows if r["sqnr_db"] is not None), key=lambda r: r["sqnr_db"], default=top
    )
    return (
        f"error concentrates in {top['node']} ({top['op_type']}): its own quantization has the "
        f"lowest SQNR, {top['local_sqnr_db']:.1f} dB ({top['rank_score'] / total:.0%} of the summed "
        f"noise; the top 3 nodes {top3:.0%}); after accumulation the lowest output SQNR is "
        f"{worst['sqnr_db']} dB at {worst['node']} ({worst['op_type']})"
    )
