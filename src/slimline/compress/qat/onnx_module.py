"""An ONNX graph as a ``torch.fx.GraphModule`` that QAT can train (``qat`` on an ONNX task).

Every Conv / ConvTranspose / BatchNormalization / Gemm becomes a real ``torch.nn`` module holding
the ONNX weights as parameters, the element-wise and data-movement ops become the torch functions
FX graph mode quantization knows (``torch.add``, ``torch.mul``, ``torch.clamp``,
``F.interpolate``, ``torch.cat``...), and scalar constants stay Python numbers. Nodes whose
inputs are all constants are folded with ONNX's reference evaluator. The op set is that of the
zoo's CNNs and detectors (PP-OCR's, YOLOX's: :data:`CONVERTERS`); any other op, or an attribute
the converter does not reproduce, is a :class:`~slimline.errors.StepError` naming it.

With ``free_batch`` (a model whose batch is fixed at 1), a constant ``Reshape`` whose first
entry is 1 where its input's first axis is 1 keeps the input's first axis instead (ONNX's ``0``),
so the module trains on batches of several rows.

Why not a converter from PyPI: ``onnx2torch`` 1.5.15 and ``onnx2pytorch`` 0.6.0, the maintained
ones, both import ``torchvision`` when imported (for their NMS / RoIAlign / DeformConv ops), and
torchvision cannot be imported beside the CPU build of torch 2.13 here. Earlier (bench), with the
import stubbed out, ``onnx2torch``'s module of PP-OCRv4's detector disagreed with ONNX Runtime
(cosine 0.03) and ``prepare_qat_fx`` could not re-trace it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import fx

from ...candidate import Candidate, quantizable_graph
from ...context import StepContext
from ...errors import StepError
from .held_out import output_arrays
from .onnx_fold import fold_conv_bias
from .onnx_ops import CONVERTERS, Builder, Dims, Env, attrs, unsupported

__all__ = ["CONVERTERS", "check_against_onnx", "module_for", "rename_outputs", "to_torch"]

# the output scale below which the conversion check's error bound stops shrinking: a probability
# map that is ~0 everywhere (a text detector on a text-free photo) is compared within 1e-6
MIN_SCALE = 1e-2
CHECK_ROWS = 32  # sample rows the conversion is checked on
CHECK_BOUND = 0.9999  # cosine to ONNX Runtime per row


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Each value's dims where ONNX shape inference finds them (a free dim is ``None``)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # inference is a help, not a requirement
        inferred = model
    g = inferred.graph
    out: dict[str, list[int | None]] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return out


def _fold(node: onnx.NodeProto, env: Env, opset: int) -> list[np.ndarray]:
    """A node whose inputs are all constants, evaluated by ONNX's reference evaluator."""
    from onnx.reference import ReferenceEvaluator

    inputs = [n for n in node.input if n]
    graph = onnx.helper.make_graph(
        [node],
        "fold",
        [
            onnx.helper.make_tensor_value_info(
                n, onnx.helper.np_dtype_to_tensor_dtype(env[n].dtype), None
            )
            for n in inputs
        ],
        [
            onnx.helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None)
            for n in node.output
        ],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        result = ReferenceEvaluator(model).run(None, {n: env[n] for n in inputs})
    except Exception as err:
        raise unsupported(node, f"its constant inputs could not be folded ({err})") from None
    return [np.asarray(r) for r in result]


# ops whose output has the rank of their (largest) input: where shape inference loses the rank
# (after a Reshape to a computed shape), it is carried on from the inputs
SAME_RANK = frozenset(CONVERTERS) - {
    "Reshape",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    "Shape",
    "Gather",
}
MULTI_OUTPUT = frozenset({"Split"})  # converters that return one value per node output


def _note_rank(b: Builder, node: onnx.NodeProto, out: str | None = None) -> None:
    out = out or node.output[0]
    if b.shapes.get(out) is not None or isinstance(b.env[out], Dims):
        return
    if node.op_type == "Reshape" and isinstance(b.env[node.input[1]], (Dims, np.ndarray)):
        rank: int | None = len(b.env[node.input[1]])
    elif node.op_type in SAME_RANK:
        ranks = [r for r in (b.rank(n) for n in node.input if n) if r is not None]
        rank = max(ranks) if ranks else None
    else:
        rank = None
    if rank is not None:
        b.shapes[out] = [None] * rank


def _check_graph(model: onnx.ModelProto) -> int:
    """The default domain's opset; float, identifier-named inputs, or an error."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    inits = {i.name for i in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        if not inp.name.isidentifier():
            raise StepError(
                f"QAT from an ONNX file needs inputs named as Python identifiers, and input "
                f"{inp.name!r} is not one; rename it in the ONNX file (and the samples)"
            )
        if inp.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
            raise StepError(
                f"QAT from an ONNX file trains on float32 inputs, and input {inp.name!r} is "
                f"{onnx.TensorProto.DataType.Name(inp.type.tensor_type.elem_type)}"
            )
    return opset


def to_torch(model: onnx.ModelProto, *, free_batch: bool = False) -> fx.GraphModule:
    """``model`` as a GraphModule (eval mode) taking its graph inputs by name, returning its one
    output, or a tuple of its outputs in the graph's order; a :class:`StepError` names the first
    op (or attribute) it cannot convert. A convolution's separate per-channel bias ``Add`` is
    folded into it first (:mod:`.onnx_fold`)."""
    opset = _check_graph(model)
    model = fold_conv_bias(model)
    b = Builder(_shapes(model), opset, free_batch)
    for init in model.graph.initializer:
        b.env[init.name] = numpy_helper.to_array(init)
    for inp in model.graph.input:
        if inp.name not in b.env:
            b.env[inp.name] = b.graph.placeholder(inp.name)
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            raise unsupported(node, f"ops of domain {node.domain} are not supported")
        if node.op_type == "Constant":
            b.env[node.output[0]] = numpy_helper.to_array(attrs(node)["value"])
            continue
        if all(isinstance(b.env.get(n), np.ndarray) for n in node.input if n):
            for name, value in zip(node.output, _fold(node, b.env, opset), strict=False):
                b.env[name] = value
            continue
        convert = CONVERTERS.get(node.op_type)
        if convert is None:
            raise StepError(
                f"unsupported ONNX op {node.op_type} (node {node.name or node.output[0]}): the "
                f"ONNX-to-torch converter for QAT covers {len(CONVERTERS)} ops of CNNs and "
                "detectors, not this one; QAT needs a torch task for this model (a task .py "
                "whose model() returns it), or use quantize without QAT"
            )
        value = convert(b, node)
        if node.op_type in MULTI_OUTPUT:  # one value per output (Split)
            for name, part in zip(node.output, value, strict=True):
                b.env[name] = part
                _note_rank(b, node, name)
        else:
            b.env[node.output[0]] = value
            _note_rank(b, node)
    outs = [b.env[o.name] for o in model.graph.output]
    for o, value in zip(model.graph.output, outs, strict=True):
        if not isinstance(value, fx.Node):
            raise StepError(
                f"the ONNX model's output {o.name!r} is a constant, not computed from the "
                "inputs: QAT trains outputs the inputs decide; remove it from the graph's outputs"
            )
    b.graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    module = fx.GraphModule(b.root, b.graph)
    module.eval()
    return module


def rename_outputs(path: Path, names: list[str]) -> None:
    """Give the outputs of the exported QDQ file ``path`` the source model's names, in order, so
    that the task's declarations (``outputs:``), its signature and its metric hook read them."""
    model = onnx.load(str(path))
    old = [o.name for o in model.graph.output]
    if len(old) != len(names):
        raise StepError(
            f"the QDQ export has {len(old)} outputs where the ONNX model has {len(names)} "
            f"({', '.join(names)}): the exporter merged or dropped some"
        )
    rename = {o: n for o, n in zip(old, names, strict=True) if o != n}
    if not rename:
        return
    taken = {t for node in model.graph.node for t in (*node.input, *node.output)} - set(old)
    for name in sorted(set(rename.values()) & taken):  # rename an inner tensor out of the way
        rename[name] = f"{name}__inner"
    for node in model.graph.node:
        node.output[:] = [rename.get(o, o) for o in node.output]
        node.input[:] = [rename.get(i, i) for i in node.input]
    for out in model.graph.output:
        out.name = rename.get(out.name, out.name)
    onnx.save(model, str(path))


def check_against_onnx(
    module: Any,
    run_onnx: Callable[[dict[str, np.ndarray]], list[np.ndarray]],
    batches: Iterable[dict[str, np.ndarray]],
    rows: int,
    bound: float,
    names: list[str] | None = None,
) -> dict[str, Any]:
    """The converted ``module`` against the ONNX model (``run_onnx``: its outputs on a batch, in
    the graph's order; ``names`` them) on up to ``rows`` sample rows: on every output, each
    row's cosine must reach ``bound``, or, for a row whose output is close to 0 everywhere
    (where cosine measures float noise), its largest error must stay within ``1 - bound`` of the
    largest output over all rows (at least of :data:`MIN_SCALE`). Returns the figures (of the
    worst output); a :class:`StepError` names the output and rows that fail."""
    got: list[list[np.ndarray]] = []
    want: list[list[np.ndarray]] = []
    seen = 0
    with torch.no_grad():
        for batch in batches:
            x = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}
            got.append(output_arrays(module(**x)))
            want.append([np.asarray(w, np.float32) for w in run_onnx(batch)])
            seen += len(got[-1][0])
            if seen >= rows:
                break
    n = min(seen, rows)
    names = names or [f"output {i}" for i in range(len(got[0]))]
    cos_all, err_all = [], []
    for i, name in enumerate(names):
        a = np.concatenate([g[i] for g in got])[:n].reshape(n, -1).astype(np.float64)
        r = np.concatenate([w[i] for w in want])[:n].reshape(n, -1).astype(np.float64)
        norms = np.linalg.norm(a, axis=1) * np.linalg.norm(r, axis=1)
        cos = np.where(norms > 0, (a * r).sum(1) / np.where(norms > 0, norms, 1.0), 1.0)
        err = np.abs(a - r).max(1)
        scale = max(float(np.abs(r).max()), MIN_SCALE)
        ok = (cos >= bound) | (err <= (1.0 - bound) * scale)
        if not ok.all():
            which = f" on output {name!r}" if len(names) > 1 else ""
            raise StepError(
                f"the torch module converted from the ONNX file disagrees with ONNX Runtime"
                f"{which} on {int((~ok).sum())} of {n} rows (cosine min {cos.min():.6f} < "
                f"{bound}, max abs error {err.max():.3g}); QAT needs a torch task for this model"
            )
        cos_all.append(cos)
        err_all.append(err)
    worst = int(np.argmin([c.mean() for c in cos_all]))
    return {
        "rows": n,
        "cosine_mean": float(cos_all[worst].mean()),
        "cosine_min": float(min(c.min() for c in cos_all)),
        "max_abs_err": float(max(e.max() for e in err_all)),
        "bound": bound,
        "rows_within": n,  # a row outside the bound raised above
    }


def module_for(cand: Candidate, ctx: StepContext) -> tuple[Any, dict[str, Any]]:
    """The trainable FP32 torch module of ``cand``'s float ONNX graph (an ONNX task's), checked
    against ONNX Runtime on the task's calibration rows, and the record of that: the file, the
    outputs' names (the QDQ export is given them back; ``output``: the first) and the check's
    figures."""
    from ...measure.runners import OrtRunner

    path = quantizable_graph(cand)
    model = onnx.load(str(path))
    sig = ctx.task.signature
    module = to_torch(model, free_batch=sig is not None and sig.max_batch == 1)
    names = [o.name for o in model.graph.output]
    runner = OrtRunner(cand.name, path, ctx.threads, sig)

    def run_onnx(batch: dict[str, np.ndarray]) -> list[np.ndarray]:
        outs = runner.run_all(batch)
        return [outs[n] for n in names]

    check = check_against_onnx(
        module, run_onnx, ctx.task.calibration_data(), CHECK_ROWS, CHECK_BOUND, names
    )
    ops = sorted({n.op_type for n in model.graph.node})
    return module, {
        "source": path.name,
        "output": names[0],
        "outputs": names,
        "ops": ops,
        "check": check,
    }
