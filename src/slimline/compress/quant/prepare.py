"""Graph preparation before quantization.

ONNX Runtime's quantization tool wants a float graph made of standard ops, with shapes inferred
and BatchNorm already folded. This module:

* converts a graph older than opset 13 to opset 13: per-channel Q/DQ needs the ``axis`` attribute
  of QuantizeLinear/DequantizeLinear, which opset 13 introduced. ONNX Runtime's quantizer writes
  it whatever the model's opset, and ONNX Runtime then refuses the model (INVALID_GRAPH,
  "Unrecognized attribute: axis for operator DequantizeLinear");
* undoes ONNX Runtime's *runtime-only* fusions (``FusedConv``, ``FusedGemm``) when the input was
  saved by its extended-level optimizer, because the quantizer does not know those ops;
* for BERT-class graphs, runs ONNX Runtime's transformer fusions (Attention, SkipLayerNorm,
  BiasGelu, EmbedLayerNorm), whose quantized kernels (QAttention, DynamicQuantizeMatMul) are what
  makes INT8 faster on CPU; the head count is found by trying candidates and checking numerically;
* runs ``quant_pre_process`` (symbolic shape inference, basic optimization: BN folding, constant
  folding) and checks the prepared graph against its source on sample inputs.
"""

from __future__ import annotations

import io
import logging
import tempfile
from collections import Counter
from contextlib import chdir, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...errors import StepError
from ...measure.quality import fidelity
from ...measure.runners import ort_session
from ...record import atomic_write_bytes
from ...task import Inputs

__all__ = ["COMPUTE_OPS", "QDQ_MIN_OPSET", "Prepared", "compute_nodes", "default_opset", "prepare"]

log = logging.getLogger("slimline.quantize")

COMPUTE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Attention")
_TRANSFORMER_FUSED = ("Attention", "SkipLayerNormalization", "EmbedLayerNormalization", "BiasGelu")
_PREP_COSINE = 0.9999
QDQ_MIN_OPSET = 13  # QuantizeLinear/DequantizeLinear take `axis` (per-channel scales) from 13


@dataclass
class Prepared:
    """The float graph that every quantized variant is made from."""

    path: Path
    compute_nodes: list[str]
    op_type: dict[str, str]
    transformer: bool
    ops: dict[str, int]
    notes: list[str] = field(default_factory=list)

    @property
    def matmul_heavy(self) -> bool:
        kinds = Counter(self.op_type.values())
        return (
            self.transformer or kinds["MatMul"] + kinds["Gemm"] + kinds["Attention"] > kinds["Conv"]
        )

    def summary(self) -> dict[str, Any]:
        return {
            "transformer": self.transformer,
            "matmul_heavy": self.matmul_heavy,
            "compute_nodes": len(self.compute_nodes),
            "ops": self.ops,
            "notes": self.notes,
        }


def compute_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Compute nodes (Conv, MatMul, Gemm, Attention...) in graph order (ONNX graphs are sorted)."""
    return [
        n
        for n in model.graph.node
        if n.op_type in COMPUTE_OPS and n.domain in ("", "com.microsoft")
    ]


def prepare(
    src: Path, out_dir: Path, sample: Inputs, *, optimize: bool = True, threads: int = 1
) -> Prepared:
    """Prepare ``src`` for quantization into ``out_dir/prepared.onnx`` and describe it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / "prepared.onnx"
    model = onnx.load(str(src))
    notes: list[str] = []
    model = _opset_for_qdq(model, notes)
    if _unfuse_runtime_ops(model):
        notes.append(
            "undid ONNX Runtime FusedConv/FusedGemm fusions (the quantizer needs plain ops)"
        )
    work = out_dir / "unfused.onnx"
    atomic_write_bytes(work, model.SerializeToString())
    transformer = _is_transformer(model)
    if optimize and transformer and not _has(model, "Attention"):
        work = fuse_transformer(work, out_dir, sample, threads, notes)
    _pre_process(work, dst, skip_optimization=not optimize or transformer, notes=notes)
    _verify(src, dst, sample, threads, "prepared graph")
    prepared = onnx.load(str(dst), load_external_data=False)
    nodes = compute_nodes(prepared)
    _name_unnamed(prepared, dst, nodes)
    nodes = compute_nodes(onnx.load(str(dst), load_external_data=False))
    if not nodes:
        raise StepError(f"nothing to quantize in {src.name}: {_why_no_compute(prepared)}")
    counts = dict(sorted(Counter(n.op_type for n in prepared.graph.node).items()))
    return Prepared(
        dst, [n.name for n in nodes], {n.name: n.op_type for n in nodes}, transformer, counts, notes
    )


_INTEGER_OPS = ("ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul", "QAttention")
_CONTROL_FLOW = ("If", "Loop", "Scan")


def _why_no_compute(model: onnx.ModelProto) -> str:
    """Why a graph has no float compute node in its main graph: already quantized, or its
    compute sits inside control-flow subgraphs. ONNX Runtime's QDQ quantizer (every static
    candidate) does not reach into subgraphs, so either way slimline keeps the parent."""
    ops = Counter(n.op_type for n in model.graph.node)
    integer = {op: ops[op] for op in _INTEGER_OPS if ops[op]}
    if integer:
        found = ", ".join(f"{n} {op}" for op, n in integer.items())
        return f"it is already quantized ({found}); the parent is kept"
    inside = Counter(n.op_type for n in _subgraph_nodes(model) if n.op_type in COMPUTE_OPS)
    if inside:
        flow = ", ".join(op for op in _CONTROL_FLOW if ops[op])
        found = ", ".join(f"{n} {op}" for op, n in sorted(inside.items()))
        return (
            f"its compute ({found}) sits inside {flow} subgraphs, which ONNX Runtime's QDQ "
            "quantizer does not reach; the parent is kept"
        )
    return "it has no Conv, MatMul, Gemm or Attention node; the parent is kept"


def _subgraph_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Every node inside the control-flow subgraphs of ``model``, at any depth."""
    found: list[onnx.NodeProto] = []
    stack = [g for n in model.graph.node for g in _graphs_of(n)]
    while stack:
        graph = stack.pop()
        for node in graph.node:
            found.append(node)
            stack.extend(_graphs_of(node))
    return found


def _graphs_of(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else list(a.graphs))]


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _opset_for_qdq(model: onnx.ModelProto, notes: list[str]) -> onnx.ModelProto:
    """``model`` at opset :data:`QDQ_MIN_OPSET` at least (ONNX's version converter), so that
    per-channel QDQ models are valid; the prepared graph is then checked against the source on
    sample inputs like any other preparation. When the converter cannot, the model stays as it
    is and the engine rejects per-channel static candidates with the reason."""
    version = default_opset(model)
    if version >= QDQ_MIN_OPSET:
        return model
    from onnx import version_converter

    try:
        converted = version_converter.convert_version(model, QDQ_MIN_OPSET)
    except Exception as err:  # the converter lacks adapters for some ops and domains
        notes.append(
            f"opset {version} could not be converted to {QDQ_MIN_OPSET} "
            f"({' '.join(str(err).split())[:200]}); per-channel static candidates need it"
        )
        return model
    notes.append(
        f"converted from opset {version} to {QDQ_MIN_OPSET}: per-channel Q/DQ needs the axis "
        "attribute of DequantizeLinear, which opset 13 introduced"
    )
    return converted


def _has(model: onnx.ModelProto, op: str) -> bool:
    return any(n.op_type == op for n in model.graph.node)


def _is_transformer(model: onnx.ModelProto) -> bool:
    counts = Counter(n.op_type for n in model.graph.node)
    if any(counts[op] for op in _TRANSFORMER_FUSED):
        return True
    has_norm = counts["LayerNormalization"] > 0 or counts["ReduceMean"] >= 4
    return counts["Softmax"] > 0 and counts["MatMul"] + counts["FusedMatMul"] >= 4 and has_norm


def _name_unnamed(model: onnx.ModelProto, path: Path, nodes: list[onnx.NodeProto]) -> None:
    if all(n.name for n in nodes):
        return
    for i, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{i}"
    atomic_write_bytes(path, model.SerializeToString())


# --- undoing runtime-only fusions ------------------------------------------------------------

_CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def _unfuse_runtime_ops(model: onnx.ModelProto) -> bool:
    changed = False
    new_nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        split = _split_fused(node, model) if node.op_type in ("FusedConv", "FusedGemm") else None
        if split is None:
            new_nodes.append(node)
            continue
        new_nodes.extend(split)
        changed = True
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(new_nodes)
    return changed


def _split_fused(node: onnx.NodeProto, model: onnx.ModelProto) -> list[onnx.NodeProto] | None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    act = (
        attrs.pop("activation", b"").decode() if isinstance(attrs.get("activation"), bytes) else ""
    )
    params = list(attrs.pop("activation_params", []))
    if node.op_type == "FusedConv":
        if len(node.input) > 3 and node.input[3]:
            return None  # FusedConv with a sum input: leave it
        base = {k: v for k, v in attrs.items() if k in _CONV_ATTRS}
        core_op = "Conv"
    else:
        if any(k.startswith("activation_") for k in attrs):
            return None
        base = {k: v for k, v in attrs.items() if k in ("alpha", "beta", "transA", "transB")}
        core_op = "Gemm"
    mid = node.output[0] + "_prefused"
    core = helper.make_node(core_op, list(node.input[:3]), [mid], name=node.name, **base)
    activation = _activation(act, params, mid, node.output[0], node.name, model)
    return None if activation is None else [core, *activation]


def _activation(
    act: str, params: list[float], x: str, y: str, name: str, model: onnx.ModelProto
) -> list[onnx.NodeProto] | None:
    if act in ("Relu", "Sigmoid", "Tanh"):
        return [helper.make_node(act, [x], [y], name=f"{name}/{act}")]
    if act == "LeakyRelu" and params:
        return [helper.make_node(act, [x], [y], name=f"{name}/{act}", alpha=params[0])]
    if act == "Clip" and len(params) == 2:
        lo, hi = f"{name}/clip_min", f"{name}/clip_max"
        model.graph.initializer.extend(
            [
                numpy_helper.from_array(np.array(params[0], np.float32), lo),
                numpy_helper.from_array(np.array(params[1], np.float32), hi),
            ]
        )
        return [helper.make_node("Clip", [x, lo, hi], [y], name=f"{name}/Clip")]
    return None


# --- transformer fusion ----------------------------------------------------------------------


def _hidden_size(model: onnx.ModelProto) -> int:
    inits = {i.name: tuple(i.dims) for i in model.graph.initializer}
    squares = Counter(
        inits[n.input[1]][0]
        for n in model.graph.node
        if n.op_type == "MatMul"
        and len(n.input) > 1
        and len(inits.get(n.input[1], ())) == 2
        and inits[n.input[1]][0] == inits[n.input[1]][1]
    )
    return squares.most_common(1)[0][0] if squares else 0


def _constant(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
    return None


def explicit_head_counts(model: onnx.ModelProto) -> int:
    """Write each attention layer's head count into its head-splitting reshape; returns how many
    were rewritten.

    Recent exports split heads with ``reshape(batch, seq, -1, head_size)``: the shape is a Concat
    whose third entry is -1, from which ONNX Runtime's attention fusion cannot read the head
    count (it then needs one global ``num_heads``, which a pruned encoder with different heads
    per layer does not have). Where the reshaped tensor comes from a projection whose width ``H``
    is known from its weight or bias, -1 means exactly ``H / head_size``; writing that number in
    changes nothing at run time and lets the fusion detect every layer's heads."""
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name: tuple(i.dims) for i in model.graph.initializer}
    done = 0
    for node in model.graph.node:
        if node.op_type != "Reshape":
            continue
        concat = producers.get(node.input[1])
        if concat is None or concat.op_type != "Concat" or len(concat.input) != 4:
            continue
        heads, size = _constant(model, concat.input[2]), _constant(model, concat.input[3])
        if heads is None or size is None or heads.size != 1 or size.size != 1:
            continue
        if int(heads.reshape(-1)[0]) != -1 or int(size.reshape(-1)[0]) <= 0:
            continue
        src = producers.get(node.input[0])
        width = None
        if src is not None and src.op_type in ("Add", "MatMul"):
            dims = [inits[i] for i in src.input if i in inits]
            if dims:
                width = dims[0][-1]
        head_size = int(size.reshape(-1)[0])
        if not width or width % head_size:
            continue
        name = f"{concat.name or concat.output[0]}/num_heads"
        value = np.array([width // head_size], dtype=heads.dtype)
        model.graph.initializer.append(numpy_helper.from_array(value, name))
        concat.input[2] = name
        done += 1
    return done


def fuse_transformer(
    src: Path, out_dir: Path, sample: Inputs | None, threads: int, notes: list[str]
) -> Path:
    """ONNX Runtime's BERT fusions of ``src``, written under ``out_dir``; returns the fused file
    (or ``src`` when every fusion changed the outputs). Head counts to try: detected (0), then
    hidden/64, /32, /128, /16; the first that fuses Attention and agrees with ``src`` on
    ``sample`` wins. Without a sample only detection is tried, unchecked."""
    from onnxruntime.transformers.optimizer import optimize_model

    model = onnx.load(str(src))
    hidden = _hidden_size(model)
    if explicit_head_counts(model):
        src_explicit = out_dir / "explicit-heads.onnx"
        atomic_write_bytes(src_explicit, model.SerializeToString())
        notes.append("head counts written into the head-splitting reshapes (exported as -1)")
    else:
        src_explicit = src
    tries = [0] + [hidden // d for d in (64, 32, 128, 16) if hidden and hidden % d == 0]
    if sample is None:
        tries = [0]
    best: tuple[int, Path, dict[str, int]] | None = None
    for heads in dict.fromkeys(tries):
        dst = out_dir / f"fused-h{heads}.onnx"
        with _quiet():
            opt = optimize_model(
                str(src_explicit),
                model_type="bert",
                num_heads=heads,
                hidden_size=hidden if heads else 0,
                opt_level=0,
            )
        stats = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
        with tempfile.TemporaryDirectory() as tmp:
            opt.save_model_to_file(str(Path(tmp) / "fused.onnx"))  # adds the com.microsoft opset
            atomic_write_bytes(dst, (Path(tmp) / "fused.onnx").read_bytes())
        if sample is not None and not _agrees(src, dst, sample, threads):
            continue
        if best is None or stats.get("Attention", 0) > best[2].get("Attention", 0):
            best = (heads, dst, stats)
        if stats.get("Attention", 0):
            break
    if best is None:
        notes.append("transformer fusion changed the outputs; kept the unfused graph")
        return src
    notes.append(
        f"transformer fusion (num_heads={best[0] or 'detected'}, hidden={hidden}): {best[2]}"
    )
    if not best[2].get("Attention"):
        notes.append(
            "no Attention fused (the export's attention pattern is not recognised; export with "
            "eager attention, e.g. attn_implementation='eager'); QAttention will not be used"
        )
    return best[1]


class _quiet:
    """Silence ONNX Runtime's quantization/fusion tools, which print and log at INFO."""

    def __enter__(self) -> None:
        self._out = redirect_stdout(io.StringIO())
        self._out.__enter__()
        self._levels = {}
        for name in ("onnxruntime", "root", "fusion_utils", "onnx_model", "fusion_attention"):
            lg = logging.getLogger(None if name == "root" else name)
            self._levels[name] = lg.level
            lg.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        for name, level in self._levels.items():
            logging.getLogger(None if name == "root" else name).setLevel(level)
        self._out.__exit__(None, None, None)


def quiet() -> _quiet:
    return _quiet()


# --- pre-processing and checks -----------------------------------------------------------------


def _pre_process(src: Path, dst: Path, *, skip_optimization: bool, notes: list[str]) -> None:
    from onnxruntime.quantization.shape_inference import quant_pre_process

    attempts: list[dict[str, bool]] = [
        {"auto_merge": True},
        {"skip_symbolic_shape": True},
    ]
    last: Exception | None = None
    src, dst = src.resolve(), dst.resolve()  # both are read after chdir below
    for opts in attempts:
        # symbolic shape inference saves its temporary model (and a .data file as large as the
        # weights) in the current directory: run it inside a temporary one under the step's own
        with tempfile.TemporaryDirectory(dir=dst.parent) as tmp, chdir(tmp), quiet():
            out = Path(tmp) / "pre.onnx"
            try:
                quant_pre_process(str(src), str(out), skip_optimization=skip_optimization, **opts)
            except Exception as err:  # symbolic shape inference fails on some dynamic shapes
                last = err
                continue
            atomic_write_bytes(dst, out.read_bytes())
        if "skip_symbolic_shape" in opts:
            notes.append("symbolic shape inference failed; used ONNX shape inference only")
        return
    raise StepError(
        f"quantization pre-processing failed on {src.name}: {last}; re-export the model"
    )


def _agrees(a: Path, b: Path, sample: Inputs, threads: int) -> bool:
    ra = ort_session(a, threads).run(None, sample)[0]
    rb = ort_session(b, threads).run(None, sample)[0]
    if ra.shape != rb.shape:
        return False
    fid = fidelity(np.asarray(rb, np.float32), np.asarray(ra, np.float32), logits=False)
    return (fid["cosine_min"] or 0.0) >= _PREP_COSINE


def _verify(src: Path, dst: Path, sample: Inputs, threads: int, what: str) -> None:
    if not _agrees(src, dst, sample, threads):
        raise StepError(
            f"the {what} disagrees with {src.name} on sample inputs (cosine < {_PREP_COSINE}); "
            "set optimize_graph: false in the quantize step"
        )
