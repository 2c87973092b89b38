"""Which float node pays for itself: the model-output gain of keeping one node alone in float.

The layer-wise ranking (:mod:`.layerwise`) says where a node's own rounding is worst; it does not
say how much of that reaches the model's output. On a depth-pruned minilm the worst-ranked node
(a fused Attention) moved the output cosine by less than 0.0001 when kept in float, while the
second (the first FFN's output projection, fed by GELU outliers) moved it by 0.0028, the whole of
what the budget needed. So mixed precision measures: for each of the first ``limit`` nodes of the
layer-wise ranking it builds the candidate with that node alone in float and evaluates it the
way the budget judges it (mean cosine to the FP32 reference outputs: after pruning, that is the
unpruned teacher, not the float graph being quantized). The gain is then priced by the node's
cost (a MAC estimate for the latency objective, its weights for the size objective), and the
nodes are tried in order of gain per cost: the budget is met by the cheapest float set the
measurements point to, not by the most float-looking one.

A dynamic candidate with 8-bit embedding tables gets one more entry, :data:`EMBEDDINGS`: the
tables kept in float (they cost no compute, only size).
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import onnx

from .config import QuantSpec
from .engine import EMBEDDING_OP_TYPES, quantize_model

__all__ = ["EMBEDDINGS", "Impact", "node_costs", "output_impact", "rank_by_impact"]

EMBEDDINGS = "<embedding tables>"


@dataclass
class Impact:
    """One node's measured effect: the score (mean cosine to the reference) with it alone in
    float, and its gain over the candidate with no extra node in float."""

    node: str
    cosine: float
    gain: float  # over the candidate with every node quantized
    cost: float  # relative: MAC estimate (latency) or weight elements (size)

    @property
    def score(self) -> float:
        return self.gain / self.cost

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "cosine": round(self.cosine, 6),
            "gain": round(self.gain, 6),
            "cost": round(self.cost, 6),
        }


def _dims(vi: onnx.ValueInfoProto) -> list[int]:
    return [d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim]


def node_costs(model: onnx.ModelProto, nodes: list[str], objective: str) -> dict[str, float]:
    """Each node's cost as a share of the largest: its constant weight elements, times (objective
    ``latency``) the output positions each weight is used at (spatial size of a convolution's
    output, sequence length of a MatMul's), where shape inference knows them. Embedding tables
    cost their elements for size, nearly nothing for latency (a lookup)."""
    with contextlib.suppress(Exception):  # shapes are a refinement: weights alone still rank
        model = onnx.shape_inference.infer_shapes(model)
    weights = {t.name: math.prod(t.dims) for t in model.graph.initializer}
    shapes = {vi.name: _dims(vi) for vi in [*model.graph.value_info, *model.graph.output]}
    by_name = {n.name: n for n in model.graph.node}
    raw: dict[str, float] = {}
    for name in nodes:
        if name == EMBEDDINGS:
            tables = [
                weights.get(i, 0)
                for n in model.graph.node
                if n.op_type in EMBEDDING_OP_TYPES
                for i in n.input
            ]
            raw[name] = float(sum(tables)) if objective == "size" else 0.0
            continue
        node = by_name.get(name)
        if node is None:
            raw[name] = 0.0
            continue
        w = float(sum(weights.get(i, 0) for i in node.input if weights.get(i, 0) > 1))
        out = shapes.get(node.output[0])
        if objective != "size" and out and len(out) > 2:
            spatial = out[2:] if node.op_type in ("Conv", "ConvTranspose") else out[1:-1]
            w *= float(math.prod(spatial))
        raw[name] = w
    top = max(raw.values(), default=0.0) or 1.0
    return {k: max(v / top, 1e-3) for k, v in raw.items()}


def output_impact(
    float_path: Path,
    spec: QuantSpec,
    float_nodes: list[str],
    candidates: list[str],
    score: Callable[[Path], float],
    caches: dict[str, Path],
    objective: str = "latency",
    progress: Callable[[int, int], None] | None = None,
    base_score: float | None = None,
) -> list[Impact]:
    """Build ``spec`` with each of ``candidates`` alone kept in float (besides ``float_nodes``)
    and return each one's gain in ``score`` (a mean cosine: in the quantize step, to the FP32
    reference outputs the budget is judged on) over the candidate with no extra node in float,
    whose score is ``base_score`` when the caller has measured it already."""

    def build_and_score(extra: str | None, tmp: Path) -> float:
        path = tmp / "probe.onnx"
        nodes = list(float_nodes)
        probe_spec = spec
        if extra == EMBEDDINGS:
            probe_spec = replace(spec, embeddings=False)
        elif extra is not None:
            nodes.append(extra)
        quantize_model(float_path, path, probe_spec, nodes, caches)
        return score(path)

    costs = node_costs(onnx.load(str(float_path)), candidates, objective)
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        base = build_and_score(None, tmp) if base_score is None else base_score
        out = []
        for i, node in enumerate(candidates):
            c = build_and_score(node, tmp)
            out.append(Impact(node, c, c - base, costs[node]))
            if progress is not None:
                progress(i + 1, len(candidates))
    return out


def rank_by_impact(ranking: list[str], impacts: list[Impact]) -> list[str]:
    """The order mixed precision tries nodes in: measured nodes that help, by gain per cost;
    then the unmeasured rest in layer-wise order; then measured nodes that did not help."""
    measured = {i.node for i in impacts}
    helps = sorted((i for i in impacts if i.gain > 0), key=lambda i: -i.score)
    useless = sorted((i for i in impacts if i.gain <= 0), key=lambda i: -i.gain)
    rest = [n for n in ranking if n not in measured]
    return [i.node for i in helps] + rest + [i.node for i in useless]
