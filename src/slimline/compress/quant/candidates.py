"""The settings the automatic mode tries on a model (:func:`candidates`), or the one setting of
``mode: static|dynamic`` (:func:`forced`): static per-channel with MinMax and Percentile
calibration, dynamic where the graph is MatMul-heavy, in the INT8 formats this CPU runs well.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Literal

import onnx

from ...cpu import CpuInt8
from ...cpu import detect as detect_cpu
from .config import QuantizeConfig, QuantSpec
from .plan import EDGES_FLOAT, EDGES_INT8, PrecisionPlan
from .prepare import Prepared

__all__ = [
    "Format",
    "candidate_specs",
    "candidates",
    "cpu_formats",
    "forced",
    "format_warnings",
    "has_embedding_tables",
]


def candidates(
    cfg: QuantizeConfig, prepared: Prepared, plan: PrecisionPlan, cpu: CpuInt8 | None = None
) -> list[tuple[QuantSpec, PrecisionPlan]]:
    """The specs of :func:`candidate_specs` for ``cpu`` (this machine by default) with the
    resolved plan. When the first/last rule was not set explicitly, the candidate that matters
    most for speed is also tried with those layers in INT8 (the budget decides): the dynamic one
    on MatMul-heavy graphs (on an encoder the "first and last layers" are an attention block and
    an FFN projection, a tenth of the work), the static MinMax one otherwise (a CNN's stem
    convolution is its largest layer)."""
    specs = candidate_specs(cfg, prepared, cpu or detect_cpu())
    out = [(spec, plan) for spec in specs]
    edges = [n for n, r in plan.rule.items() if r == EDGES_FLOAT]
    if edges and "keep_first_last_float" not in cfg.model_fields_set:
        fast = "dynamic" if prepared.matmul_heavy else "static"
        spec = next(sp for sp in specs if sp.mode == fast)
        out.append((spec, plan.with_int8(edges, EDGES_INT8)))
    return out


def forced(
    cfg: QuantizeConfig, prepared: Prepared, plan: PrecisionPlan
) -> list[tuple[QuantSpec, PrecisionPlan]]:
    """The one setting of ``mode: static|dynamic``; tables in INT8 only where the graph has any."""
    spec = QuantSpec.from_config(cfg)
    if spec.embeddings and not has_embedding_tables(prepared):
        spec = replace(spec, embeddings=False)
    return [(spec, plan)]


def candidate_specs(cfg: QuantizeConfig, prepared: Prepared, cpu: CpuInt8) -> list[QuantSpec]:
    """Static per-channel with MinMax (and Percentile for the first format); dynamic per-channel
    where the graph is MatMul-heavy; one of each for every format of :func:`cpu_formats`. On a
    convolutional graph the first format is also tried with Q/DQ around the compute ops only
    (``quantize_ops: compute``): on PP-OCRv4's text detector the element-wise requantizations
    of the default placement cost more fidelity than the convolutions' own (mean cosine to FP32
    0.774 vs 0.870); which runs faster is measured like the rest.

    Dynamic candidates store the graph's embedding tables in 8 bits too (``quantize_embeddings``,
    the default): on all-MiniLM-L6-v2 that takes the file from 62 to 23 MB, and the table
    lookup it changes is about 1% of the run time (ONNX Runtime's profile of the quantized
    model), so it cannot cost measurable speed; its fidelity is measured like everything else."""
    tables = cfg.quantize_embeddings and prepared.matmul_heavy and has_embedding_tables(prepared)
    specs: list[QuantSpec] = []
    for i, (act, weight, reduce_range) in enumerate(cpu_formats(cfg, cpu)):
        base = QuantSpec(
            mode="static",
            per_channel=True,
            activation_type=act,
            weight_type=weight,
            activation_symmetric=cfg.activation_symmetric,
            weight_symmetric=cfg.weight_symmetric,
            percentile=cfg.percentile,
            reduce_range=reduce_range,
            ops=cfg.quantize_ops,
        )
        specs.append(replace(base, calibration="minmax"))
        if i == 0:
            specs.append(replace(base, calibration="percentile"))
        if i == 0 and cfg.quantize_ops == "all" and not prepared.matmul_heavy:
            specs.append(replace(base, calibration="minmax", ops="compute"))
        if prepared.matmul_heavy:
            specs.append(replace(base, mode="dynamic", calibration="minmax", embeddings=tables))
    return sorted(specs, key=lambda sp: sp.mode == "dynamic")  # static first, as before


Format = tuple[Literal["uint8", "int8"], Literal["int8", "uint8"], bool]


def cpu_formats(cfg: QuantizeConfig, cpu: CpuInt8) -> list[Format]:
    """(activation type, weight type, reduce_range) worth trying on ``cpu``.

    ONNX Runtime runs U8S8 on x86 with VPMADDUBSW, whose 16-bit pair sums can saturate unless
    the CPU has VNNI (AVX512-VNNI, AVX-VNNI, AMX). Its documentation recommends 7-bit weights
    (``reduce_range``) for U8S8 there, or U8U8, which never saturates. With VNNI, on ARM, or
    when the types or ``reduce_range`` are set explicitly in the recipe, the config's format
    alone."""
    own: Format = (cfg.activation_type, cfg.weight_type, cfg.reduce_range)
    explicit = {"activation_type", "weight_type", "reduce_range"} & cfg.model_fields_set
    if explicit or not cpu.u8s8_saturates:
        return [own]
    return [("uint8", "int8", True), ("uint8", "uint8", False)]


def format_warnings(specs: Iterable[QuantSpec], cpu: CpuInt8) -> list[str]:
    """The formats the user forced that ``cpu`` runs badly, with the risk named. They still
    run; the measured fidelity decides."""
    risky = list(dict.fromkeys(sp.label for sp in specs if sp.saturates_without_vnni))
    if not cpu.u8s8_saturates or not risky:
        return []
    return [
        f"{'; '.join(risky)}: U8S8 with 8-bit weights can saturate 16-bit sums on this CPU "
        f"({cpu.describe()}, no VNNI); ONNX Runtime recommends reduce_range: true or U8U8 "
        "(weight_type: uint8) there; running it anyway, its measured fidelity decides"
    ]


def has_embedding_tables(prepared: Prepared) -> bool:
    """Whether the graph looks up a constant table: a fused EmbedLayerNormalization, or a Gather
    whose data is an initializer (what ONNX Runtime's dynamic quantizer stores as INT8)."""
    if not (prepared.ops.get("EmbedLayerNormalization") or prepared.ops.get("Gather")):
        return False
    model = onnx.load(str(prepared.path), load_external_data=False)
    consts = {t.name for t in model.graph.initializer}
    return any(
        n.op_type == "EmbedLayerNormalization" or (n.op_type == "Gather" and n.input[0] in consts)
        for n in model.graph.node
    )
