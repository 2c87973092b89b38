"""Typed step records: what a step writes into its candidate's ``meta`` and the report reads back.

A record travels as JSON (the manifest), so it is a ``TypedDict``: the step that writes it and
the report section that reads it are checked against one declaration, and a key renamed on one
side is a type error on the other. Keys a step writes only in some runs are optional
(``total=False``); readers use ``.get`` for those.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict, cast

__all__ = [
    "PruneRecord",
    "QuantizeAlternativeRecord",
    "QuantizeRecord",
    "SearchRecord",
    "TrialDescription",
    "TrialSummary",
    "prune_record",
    "quantize_record",
]


class TrialSummary(TypedDict):
    """One quantization trial as the search table shows it."""

    name: str
    label: str
    float_nodes: int
    kernels: str
    latency_p50_ms: float | None
    fp32_p50_ms: float | None
    ratio_vs_fp32: float | None
    faster_than_fp32: bool
    bands_separated: bool
    budget_ok: bool
    fidelity: dict[str, Any] | None
    metric: float | None
    failure: str | None
    screened: str | None  # over budget on this subset of the rows, not evaluated on the rest
    timing_stopped: str | None  # timed on fewer rounds: it could no longer be faster than FP32
    slow_at_any_range: str | None  # timed before full calibration, slower than FP32 at any ranges
    size_bytes: int | None


class SearchRecord(TypedDict, total=False):
    """How the quantize step searched: every trial, the mixed-precision trace, and why none met
    the budget when none did."""

    candidates: list[TrialSummary]
    fp32_latency_ms: dict[str, Any] | None
    mixed_precision: list[dict[str, Any]]
    recalibration: dict[str, Any]  # a near miss rebuilt with the calibrations not yet tried
    no_candidate_met_budget: str
    stopped: str  # why the search ended where it did
    speed_check: dict[str, Any]  # the static candidates timed before calibrating on all rows


class QuantizeAlternativeRecord(TypedDict):
    """A quantization trial that was not chosen, kept as an alternative row."""

    config: dict[str, Any]
    label: str
    kernels: dict[str, Any]
    precision_map: dict[str, Any]
    fallback_report: str


class TrialDescription(QuantizeAlternativeRecord):
    """The chosen trial: an alternative's fields plus its per-layer error and latency ratio."""

    layerwise: list[dict[str, Any]]
    layerwise_statement: str | None
    latency_ratio_vs_fp32: float | None
    notes: list[str]


class _QuantizeOptional(TypedDict, total=False):
    no_candidate_met_budget: str


class QuantizeRecord(TrialDescription, _QuantizeOptional):
    """The quantize step's record of what it applied, how it searched and what it cost."""

    mode: str
    prepared: dict[str, Any]
    calibration: dict[str, Any]
    representativeness: dict[str, Any]
    distributions: dict[str, Any] | None
    search: SearchRecord
    step_wall_s: float
    timings_s: dict[str, float]


class PruneRecord(TypedDict, total=False):
    """The prune step's record: plan, groups, sensitivity sweep, recovery rounds, cost shares,
    the export check, the torch-side view, and the files it saved to restore the module."""

    plan: dict[str, float]
    planned: dict[str, Any] | None
    groups: dict[str, dict[str, Any]]
    skipped_groups: dict[str, str]
    sensitivity: dict[str, Any] | None
    rounds: list[dict[str, Any]]
    resumed_after_round: int
    importance: list[str]
    finetune_data: str
    macs: dict[str, Any]
    params: dict[str, Any]
    export_check: dict[str, Any]
    torch: dict[str, Any] | None
    layers: dict[str, Any] | None  # depth pruning: stack, plan, sensitivity, recovery, options
    history: list[Any]
    weights: str
    history_file: str


def quantize_record(meta: Mapping[str, Any]) -> QuantizeRecord:
    """A quantize candidate's ``meta`` (from a manifest) as its typed record."""
    return cast(QuantizeRecord, meta)


def prune_record(meta: Mapping[str, Any]) -> PruneRecord:
    """A prune candidate's ``meta`` (from a manifest) as its typed record."""
    return cast(PruneRecord, meta)
