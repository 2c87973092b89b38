"""Depth and width together, priced by measured latency on the target.

MACs do not say what a shape costs: dropping a whole layer also removes its layer norms,
residual adds and per-layer overheads, thinning heads and neurons does not. So the options (drop
the ``k`` least sensitive layers, for every ``k`` allowed, then thin what is left by each
share of ``widths``) are built as shapes before any recovery (width by L2 magnitude, the same
share in every group), exported, quantized dynamically (S8 per-channel) when the recipe
quantizes later, and timed interleaved against the unpruned model on the target runtime at
batch 1 (median per-round ratio). Each shape's loss before recovery is measured on the
sensitivity subset (metric drop + ``fidelity_weight`` x (1 - cosine)). The plan is the option
with the least loss among those at or below the ``latency`` share; an option that fails to
build, export or quantize is left out with its reason.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...candidate import Candidate
from ...errors import StepError
from ...export import export_module
from ...measure.latency import benchmark, paired_speedup
from ...module_guard import private_copy
from ...recipe import BenchConfig
from .depth import StackInfo, drop_layers, droppable
from .graph import CostModel, PruneGraph
from .planner import plan_from_ratios

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import Tensor, nn

    from ...tensors import Inputs
    from .sensitivity import Evaluator

__all__ = ["Option", "ShapeSpec", "choose", "least_sensitive", "price_options"]

log = logging.getLogger("slimline.prune")


@dataclass
class Option:
    name: str
    dropped: list[int]
    keep: list[int]
    width: float  # share removed from every width group of the kept layers
    loss: float | None = None  # measured before recovery
    ratio: float | None = None  # latency / the unpruned model's, median per-round ratio
    p50_ms: float | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ShapeSpec:
    """How width options are thinned (the prune step's own settings)."""

    exclude: tuple[str, ...]
    keep_first_last: bool
    round_to: int
    max_ratio: float
    by: str


def least_sensitive(table: dict[str, Any], k: int) -> list[int]:
    """The ``k`` layers of the sensitivity table with the least loss (ties: lower index)."""
    rows = sorted(table["rows"], key=lambda r: (float(r["loss"]), int(r["layer"])))
    return sorted(int(r["layer"]) for r in rows[:k])


def build_shape(
    teacher: nn.Module,
    stack: StackInfo,
    keep: list[int],
    width: float,
    spec: ShapeSpec,
    example: dict[str, Tensor],
) -> Any:
    """A copy of ``teacher`` with only ``keep`` layers, thinned by ``width`` (no recovery)."""
    import torch_pruning as tp

    model = drop_layers(private_copy(teacher).eval(), stack.path, keep)
    if width <= 0:
        return model
    graph = PruneGraph(
        model,
        example,
        exclude=list(spec.exclude),
        keep_first_last=spec.keep_first_last,
        round_to=spec.round_to,
    )
    ratios = {n: min(width, spec.max_ratio) for n in graph.groups}
    plan = plan_from_ratios(
        graph.groups,
        ratios,
        CostModel(graph),
        by="macs" if spec.by == "macs" else "params",
        max_ratio=spec.max_ratio,
        round_to=spec.round_to,
    )
    magnitude = tp.importance.GroupMagnitudeImportance(p=2)
    for name, k in plan.keep.items():
        graph.prune_to(name, k, magnitude)
    return graph.model.eval()


def _options(
    table: dict[str, Any], stack: StackInfo, keep_first_last: bool, widths: list[float]
) -> list[Option]:
    out = []
    for k in range(len(droppable(stack.size, keep_first_last)) + 1):
        if k >= stack.size:
            break
        dropped = least_sensitive(table, k)
        keep = [i for i in range(stack.size) if i not in dropped]
        for w in widths:
            out.append(Option(f"drop{k}-width{w:g}", dropped, keep, float(w)))
    return out


def _onnx(module: nn.Module, sample: Inputs, path: Path, opset: int, int8: bool) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32 = export_module(module, sample, path, opset)
    if not int8:
        return fp32
    out = path.with_name(path.stem + "-int8.onnx")
    quantize_dynamic(str(fp32), str(out), weight_type=QuantType.QInt8, per_channel=True)
    return out


def price_options(
    *,
    teacher: nn.Module,
    stack: StackInfo,
    table: dict[str, Any],
    widths: list[float],
    keep_first_last: bool,
    spec: ShapeSpec,
    evaluator: Evaluator,
    fidelity_weight: float,
    example: dict[str, Tensor],
    sample: dict[str, Any],
    workdir: Path,
    opset: int,
    int8: bool,
    threads: int,
    rounds: int,
) -> list[Option]:
    """Every option built, scored before recovery and timed interleaved with the unpruned
    model (``Option.ratio``; a failed option keeps its ``error``)."""
    start = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    options = _options(table, stack, keep_first_last, widths)
    cands: dict[str, Candidate] = {}
    for opt in options:
        try:
            shape = build_shape(teacher, stack, opt.keep, opt.width, spec, example)
            score = evaluator.score(shape)
            opt.loss = max(0.0, evaluator.base_metric - score["metric"])
            opt.loss += fidelity_weight * max(0.0, 1.0 - score["cosine"])
            path = _onnx(shape, sample, workdir / f"{opt.name}.onnx", opset, int8)
            cands[opt.name] = Candidate(opt.name, "prune", None, onnx=path)
        except Exception as err:  # one option failing rejects that option only
            opt.error = f"{type(err).__name__}: {str(err)[:300]}"
            log.warning("prune plan option %s left out: %s", opt.name, opt.error)
    base = options[0].name  # drop 0, width 0: the unpruned model
    if base not in cands:
        raise StepError(f"the unpruned model could not be priced: {options[0].error}")
    bench = BenchConfig(rounds=rounds, runs_per_round=max(30, -(-200 // rounds)), warmup=5)
    timed = benchmark(list(cands.values()), sample, bench, threads, throughput=False,
                      desc="price plans")  # fmt: skip
    for opt in options:
        if opt.name in timed:
            lat = timed[opt.name]["latency_ms"]
            opt.ratio = float(paired_speedup(timed[base]["latency_ms"], lat)["ratio"])
            opt.p50_ms = float(lat["p50"])
    log.info("prune plan: %d options priced in %.0f s", len(options), time.perf_counter() - start)
    return options


def choose(options: list[Option], latency: float) -> Option:
    """The least loss before recovery among the options at or below ``latency``."""
    fits = [o for o in options if o.ratio is not None and o.loss is not None and o.ratio <= latency]
    if not fits:
        priced = [o for o in options if o.ratio is not None]
        fastest = min(priced, key=lambda o: o.ratio or 1.0) if priced else None
        best = f"; the fastest, {fastest.name}, timed {fastest.ratio:.3f}x" if fastest else ""
        raise StepError(
            f"no depth/width option reaches {latency:.2f}x of the unpruned latency{best}; "
            "raise `layers.latency`, add larger `widths`, or allow dropping the first and last "
            "layers (`keep_first_last: false`)"
        )
    return min(fits, key=lambda o: (o.loss or 0.0, len(o.dropped), o.width))
