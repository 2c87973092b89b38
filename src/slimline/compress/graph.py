"""Graph optimization: inputs frozen and control flow folded, then ONNX Runtime's offline graph
optimizer and its transformer fusions.

First (:mod:`.freeze`) the recipe's ``constant_inputs`` become constants and onnxscript's
optimizer folds what they decide (an ``If`` on a sample rate inlines its branch); a graph with
``If`` nodes gets the fold without a declaration too, where conditions are static given its
fixed shapes. That folded float graph is what quantization reads.

ONNX Runtime folds BatchNorm into the preceding Conv, fuses Conv+activation, Gemm+activation,
constant-folds, and (``transformer: bert``) fuses attention, LayerNorm, GELU and embedding
subgraphs into its contrib kernels. The optimized graph is saved, and the op counts before and
after go into the candidate's record so the change can be inspected.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar, Literal

import onnx

from ..candidate import QUANTIZABLE_SOURCE, Candidate, quantizable_graph
from ..context import StepContext
from ..errors import error_text
from ..measure.runners import ort_session
from ..recipe import StepConfig
from ..steps import Contract, step
from ..task import Inputs
from ..tensors import drop_frozen, frozen_inputs
from .freeze import freeze_and_fold
from .quant.prepare import fuse_transformer

__all__ = ["GraphConfig", "is_transformer", "op_counts", "optimize_graph"]

log = logging.getLogger("slimline.graph")
SOURCE_FILE = "source.onnx"  # the float graph the optimized one was made from


class GraphConfig(StepConfig):
    kind: ClassVar[str] = "graph"
    level: Literal["basic", "extended"] = "extended"
    transformer: Literal["auto", "bert", "none"] = "auto"


def op_counts(path: Path) -> dict[str, int]:
    model = onnx.load(str(path), load_external_data=False)
    return dict(sorted(Counter(n.op_type for n in model.graph.node).items()))


def is_transformer(counts: dict[str, int]) -> bool:
    """A graph with softmax attention over MatMuls and layer norms is treated as BERT-class."""
    has_norm = counts.get("LayerNormalization", 0) > 0 or counts.get("ReduceMean", 0) >= 4
    return counts.get("Softmax", 0) > 0 and counts.get("MatMul", 0) >= 4 and has_norm


def optimize_graph(
    src: Path, dst: Path, cfg: GraphConfig, threads: int, sample: Inputs | None = None
) -> dict[str, Any]:
    """ONNX Runtime's offline optimization of ``src`` at ``cfg.level`` into ``dst``; for a
    BERT-class graph, first its transformer fusions. With a ``sample``, the fusion tries the
    head counts the hidden size allows and keeps the one that fuses Attention and still agrees
    with ``src`` on the sample (auto-detection fails on the legacy exporter's reshapes); without,
    it lets the fuser detect them."""
    before = op_counts(src)
    work = src
    notes: list[str] = []
    fused = cfg.transformer == "bert" or (cfg.transformer == "auto" and is_transformer(before))
    scratch = dst.with_name(dst.stem + ".fusion")
    if fused and sample is not None:  # the fused graphs take what the source takes
        sample = drop_frozen(sample, _input_names(src), frozen_inputs(src), "graph")
    if fused:
        scratch.mkdir(parents=True, exist_ok=True)
        work = fuse_transformer(src, scratch, sample, threads, notes)
    tmp = dst.with_name(f".{dst.name}.tmp")
    ort_session(work, threads, optimized_out=tmp, level=cfg.level)
    tmp.replace(dst)
    shutil.rmtree(scratch, ignore_errors=True)
    after = op_counts(dst)
    folded = before.get("BatchNormalization", 0) - after.get("BatchNormalization", 0)
    return {
        "level": cfg.level,
        "transformer_fusion": fused,
        "ops_before": before,
        "ops_after": after,
        "batchnorm_folded": folded,
        "attention_fused": after.get("Attention", 0),
        "notes": notes,
        "nodes_before": sum(before.values()),
        "nodes_after": sum(after.values()),
    }


def _input_names(path: Path) -> set[str]:
    model = onnx.load(str(path), load_external_data=False)
    return {i.name for i in model.graph.input}


def _fold_first(src: Path, ctx: StepContext) -> tuple[Path, dict[str, Any]]:
    """The frozen, folded graph (:mod:`.freeze`) and its record; the source itself, with the
    reason, where that pass fails (the step goes on without it)."""
    try:
        return freeze_and_fold(
            src,
            ctx.workdir / "folded.onnx",
            ctx.task.constant_inputs,
            ctx.task.sample_inputs(1),
            ctx.threads,
        )
    except Exception as err:  # a graph the pass cannot load, save or run: skip the pass
        log.warning("graph: freezing/folding skipped: %s", error_text(err))
        return src, {"frozen": {}, "if_folded": 0, "fold": f"failed: {error_text(err)}"}


def _link_source(src: Path, workdir: Path) -> str:
    """Keep, beside the optimized graph, the float graph it was made from: ONNX Runtime's saved
    optimizations are runtime-only fusions that quantization cannot read (a hard link where the
    file system allows, so no second copy of the weights)."""
    dst = workdir / SOURCE_FILE
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return SOURCE_FILE


@step(
    GraphConfig,
    contract=Contract(
        consumes=("onnx", "onnx-int8"), produces=(), keeps=("torch", "onnx", "onnx-int8")
    ),
    version=2,
    reads=("target.threads", "constant_inputs"),
    packages=("onnx", "onnxruntime", "numpy", "onnxscript"),
)
def graph_step(cfg: GraphConfig, cand: Candidate, ctx: StepContext) -> Candidate:
    assert cand.onnx is not None, "graph runs on an exported candidate"
    source, folding = _fold_first(quantizable_graph(cand), ctx)
    start = source if source != quantizable_graph(cand) else Path(cand.onnx)
    record = optimize_graph(
        start, ctx.workdir / "model.onnx", cfg, ctx.threads, ctx.task.sample_inputs(1)
    )
    record.update(folding)
    log.info(
        "graph: %d -> %d nodes, %d BatchNorm folded, transformer fusion %s, %d If folded",
        record["nodes_before"],
        record["nodes_after"],
        record["batchnorm_folded"],
        record["transformer_fusion"],
        record["if_folded"],
    )
    return Candidate(
        name="graph",
        step="graph",
        parent=cand.name,
        onnx=ctx.workdir / "model.onnx",
        module=cand.module,
        meta={**record, QUANTIZABLE_SOURCE: _link_source(source, ctx.workdir)},
    )
