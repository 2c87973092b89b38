"""The graph step's first pass: inputs frozen into constants, and control flow folded.

A recipe's ``constant_inputs`` (e.g. ``{sr: 16000}``) names inputs that take one value in
deployment. They become initializers and leave the model's inputs, and onnxscript's optimizer
then folds what they decide: constants, and ``If`` nodes whose condition is now static (their
branch is inlined). Without a declaration the pass still runs on a graph with ``If`` nodes, whose
conditions may be static given the model's fixed shapes.

The result is kept only where it changed something (an input frozen, an ``If`` folded) and it
agrees with the source on a sample row; otherwise the source goes on unchanged, with the reason
in the record. The frozen values are written into the file's ``metadata_props``
(:data:`~slimline.tensors.FROZEN_KEY`), so runners and the server drop the input from feeds that
still carry it, and reject another value.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ..errors import error_text
from ..measure.runners import ort_session
from ..tensors import FROZEN_KEY, Inputs, drop_frozen, frozen_inputs, frozen_to_json

__all__ = ["count_if", "freeze_and_fold"]

log = logging.getLogger("slimline.graph")


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            for sub in attr.graphs:
                yield from _graphs(sub)


def count_if(model: onnx.ModelProto) -> int:
    """``If`` nodes in the model, its subgraphs included."""
    return sum(n.op_type == "If" for g in _graphs(model.graph) for n in g.node)


def _freeze(model: onnx.ModelProto, constants: Mapping[str, np.ndarray]) -> None:
    """Turn each named graph input into an initializer holding its value."""
    keep = [i for i in model.graph.input if i.name not in constants]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    for name, value in constants.items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(value), name))


def _set_frozen(model: onnx.ModelProto, constants: Mapping[str, np.ndarray]) -> None:
    entries = [(p.key, p.value) for p in model.metadata_props if p.key != FROZEN_KEY]
    del model.metadata_props[:]
    for key, value in entries:
        model.metadata_props.add(key=key, value=value)
    if constants:
        model.metadata_props.add(key=FROZEN_KEY, value=frozen_to_json(constants))


def _fold(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxscript.optimizer

    quiet = logging.getLogger("onnx_ir")  # one INFO line per deduplicated initializer
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        folded: onnx.ModelProto = onnxscript.optimizer.optimize(model)
    finally:
        quiet.setLevel(level)
    return folded


def _agrees(src: Path, dst: Path, sample: Inputs, threads: int) -> str | None:
    """None when ``dst`` computes what ``src`` does on ``sample``; else what differs."""
    a, b = ort_session(src, threads), ort_session(dst, threads)
    feed_a = drop_frozen(sample, {i.name for i in a.get_inputs()}, frozen_inputs(src), "source")
    feed_b = drop_frozen(sample, {i.name for i in b.get_inputs()}, frozen_inputs(dst), "folded")
    for out, x, y in zip(a.get_outputs(), a.run(None, feed_a), b.run(None, feed_b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or not np.allclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True):
            return f"output {out.name!r} differs from the source's on a sample row"
    return None


def freeze_and_fold(
    src: Path,
    dst: Path,
    constants: Mapping[str, np.ndarray],
    sample: Inputs | None,
    threads: int,
) -> tuple[Path, dict[str, Any]]:
    """(the graph to optimize next: ``dst``, or ``src`` where the pass changed nothing or
    failed; the record: ``frozen``, ``if_before``, ``if_folded``, ``fold``)."""
    model = onnx.load(str(src), load_external_data=False)  # the weights only where needed
    takes = {i.name for i in model.graph.input}
    already = frozen_inputs(src)  # a graph frozen by an earlier graph step keeps its record
    frozen = {k: np.asarray(v) for k, v in constants.items() if k in takes}
    before = count_if(model)
    record: dict[str, Any] = {
        "frozen": {k: v.tolist() for k, v in frozen.items()},
        "if_before": before,
        "if_folded": 0,
    }
    if not frozen and before == 0:
        record["fold"] = "not run: no If node and no constant input"
        return src, record
    onnx.load_external_data_for_model(model, str(src.parent))
    _freeze(model, frozen)
    try:
        out = _fold(model)
    except Exception as err:  # onnxscript's optimizer on a graph it does not handle
        record["fold"] = f"onnxscript's optimizer failed: {error_text(err)}"
        out = model
    else:
        record["fold"] = "onnxscript.optimizer.optimize"
        record["if_folded"] = before - count_if(out)
    if not frozen and record["if_folded"] <= 0:
        record["fold"] = f"kept the source: {record['fold']} folded no If node"
        record["if_folded"] = 0
        return src, record
    _set_frozen(out, {**already, **frozen})
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(out, str(dst))
    why = _agrees(src, dst, sample, threads) if sample else None
    if why is not None and out is not model:  # keep the freeze, drop onnxscript's rewrite
        record["fold"] = f"rejected onnxscript's optimizer: {why}"
        record["if_folded"] = 0
        _set_frozen(model, {**already, **frozen})
        onnx.save(model, str(dst))
        if not frozen:
            return src, record
    log.info("graph: froze %s, folded %d If node(s)", sorted(frozen), record["if_folded"])
    return dst, record
