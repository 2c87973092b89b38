"""Automatic mode: build candidate settings suited to the model, measure them all interleaved
against FP32, keep the fastest within budget; keep the worst layers in float when none is."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import onnx

from ...candidate import Candidate
from ...context import StepContext
from ...cpu import CpuInt8
from ...cpu import detect as detect_cpu
from ...errors import StepError, error_text, is_user_error
from ...measure.latency import speed_verdict
from ...measure.quality import Quality
from ...measure.runners import check_candidate
from ...measure.screen import best_case, can_screen
from ...records import SearchRecord, TrialDescription
from ...task import Inputs
from .config import QuantizeConfig, QuantSpec
from .engine import quantize_model
from .fallback import fallback_warning, kernel_report
from .impact import EMBEDDINGS, output_impact, rank_by_impact
from .layerwise import error_statement, layer_errors
from .plan import EDGES_FLOAT, EDGES_INT8, MIXED, PrecisionPlan
from .prepare import Prepared

__all__ = [
    "Trial",
    "all_failed",
    "candidate_specs",
    "candidates",
    "clearly_smaller",
    "cpu_formats",
    "forced",
    "format_warnings",
    "has_embedding_tables",
    "pick",
    "search",
]

log = logging.getLogger("slimline.quantize")

SCREEN_MIN_ROWS = 8  # screening evaluates a quarter of the rows, at least this many

NOT_BUILT: dict[str, Any] = {
    "int8_kernels": 0,
    "compute_kernels": 0,
    "summary": "not built",
    "int8_share": 0.0,
    "fallback": [],
    "float_by_choice": 0,
    "kernels": {},
}


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


@dataclass
class Trial:
    """One quantized variant: its file, what the runtime does with it, and its measurements."""

    spec: QuantSpec
    plan: PrecisionPlan
    path: Path
    kernels: dict[str, Any] = field(default_factory=lambda: dict(NOT_BUILT))
    quality: Quality | None = None
    latency: dict[str, Any] | None = None
    fp32: dict[str, Any] | None = None  # FP32 latency measured in the same interleaved run
    budget_ok: bool = False
    budget_reason: str = ""
    notes: list[str] = field(default_factory=list)
    failure: str | None = None  # why this trial could not be built, checked, evaluated or timed
    screened: str | None = None  # rejected on a subset of the rows: the rows, and why

    @property
    def name(self) -> str:
        return f"quantize:{self.spec.slug}{self.plan.tag}"

    @property
    def label(self) -> str:
        tag = self.plan.tag
        if tag.startswith("-mixed"):
            return f"{self.spec.label}, {tag[6:]} nodes kept float"
        return self.spec.label + (", first/last layers INT8" if tag == "-edges-int8" else "")

    @property
    def size(self) -> int:
        return self.path.stat().st_size

    def p50(self) -> float:
        assert self.latency is not None
        return float(self.latency["p50"])


@dataclass
class Search:
    """Everything the search needs, so it can run with or without a pipeline."""

    ctx: StepContext
    cfg: QuantizeConfig
    prepared: Prepared
    caches: dict[str, Path]
    out_dir: Path
    eval_inputs: Callable[[], Iterable[Inputs]]
    trials: list[Trial] = field(default_factory=list)
    mixed_trace: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timed(self, what: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[what] = round(self.timings.get(what, 0.0) + time.perf_counter() - t0, 3)

    def build(self, spec: QuantSpec, plan: PrecisionPlan, tag: str = "") -> Trial:
        """Write one variant and check it (``onnx.checker`` plus an ONNX Runtime load); a
        failure rejects this trial with its reason, never the step."""
        trial = Trial(spec, plan, self.out_dir / f"{spec.slug}{tag}.onnx")
        try:
            quantize_model(self.prepared.path, trial.path, spec, plan.float_nodes, self.caches)
            check_candidate(trial.path, self.ctx.threads)
            trial.kernels = kernel_report(trial.path, self.ctx.threads)
        except Exception as err:
            return self.fail(trial, "building", err)
        warn = fallback_warning(spec.label, trial.kernels)
        if warn:
            trial.notes.append(warn)
        return trial

    def fail(self, trial: Trial, stage: str, err: Exception) -> Trial:
        """Reject ``trial``: the runtime's or library's message, with the config that made it.
        An error in the user's input is not the trial's: it still ends the run."""
        if is_user_error(err):
            raise err
        trial.failure = f"{trial.label}: {stage} failed: {error_text(err)}"
        trial.budget_ok, trial.budget_reason = False, trial.failure
        log.warning("quantize: candidate rejected: %s", trial.failure)
        return trial

    def judge(self, trial: Trial) -> Trial:
        """Quality and budget verdict of ``trial``: on a subset of the rows first
        (:meth:`screen`), on all of them unless the subset puts the budget out of reach."""
        if trial.failure:
            return trial
        try:
            if self.screen(trial):
                return trial
            trial.quality = self.ctx.evaluate(self.candidate(trial))
        except Exception as err:
            return self.fail(trial, "evaluating", err)
        trial.budget_ok, trial.budget_reason = self.ctx.within_budget(trial.quality)
        return trial

    def screen(self, trial: Trial) -> bool:
        """Whether ``trial`` is over budget by its first rows alone: even with every other row
        matching FP32, it would miss (:func:`~slimline.measure.screen.best_case`)."""
        n = len(self.ctx.reference.outputs)
        k = max(SCREEN_MIN_ROWS, n // 4)
        if not self.cfg.screen or n < 2 * k or not can_screen(self.ctx.task, self.ctx.reference):
            return False
        with self.timed("screen"):
            q = self.ctx.evaluate_rows(self.candidate(trial), k)
        if q is None:
            return False
        ok, why = self.ctx.within_budget(best_case(q, self.ctx.task, k, n))
        if ok:
            return False
        trial.quality, trial.budget_ok = q, False
        trial.screened = f"{k} of {n} rows"
        trial.budget_reason = (
            f"over budget on the first {k} of {n} evaluation rows, even if the other {n - k} "
            f"matched FP32 exactly: at best {why}"
        )
        return True

    def usable(self) -> list[Trial]:
        return [t for t in self.trials if t.failure is None]

    def candidate(self, trial: Trial, parent: str = "") -> Candidate:
        return Candidate(name=trial.name, step="quantize", parent=parent or None, onnx=trial.path)

    def measure(self, trials: list[Trial]) -> None:
        """Time ``trials`` interleaved with FP32. When that fails, each is timed alone with FP32
        so that one trial's failure rejects that trial only."""
        trials = [t for t in trials if t.failure is None]
        if not trials:
            return
        try:
            self._time(trials)
        except Exception as err:
            if is_user_error(err) or len(trials) == 1:
                self.fail(trials[0], "timing", err)
                return
            for t in trials:
                try:
                    self._time([t])
                except Exception as one:
                    self.fail(t, "timing", one)

    def _time(self, trials: list[Trial]) -> None:
        base = self.ctx.baseline
        figures = self.ctx.compare([base, *[self.candidate(t) for t in trials]])
        for t in trials:
            t.latency, t.fp32 = figures[t.name]["latency_ms"], figures[base.name]["latency_ms"]

    @property
    def objective(self) -> str:
        return self.ctx.recipe.budget.objective

    def faster(self, trial: Trial) -> bool:
        """Faster than FP32 for choosing among candidates: the median wins by ``min_gain`` and the
        band of per-round medians sits lower at both ends (its best and its worst round beat
        FP32's). The pipeline then applies its own test to the candidate returned (bands apart, or
        faster round by round by a sign test, measuring again when that is inconclusive)."""
        if trial.latency is None or trial.fp32 is None:
            return False
        gain = self.ctx.recipe.budget.min_gain
        band, fp32 = trial.latency["band"], trial.fp32["band"]
        return bool(
            trial.p50() < (1.0 - gain) * trial.fp32["p50"]
            and band[0] < fp32[0]
            and band[1] < fp32[1]
        )

    def separated(self, trial: Trial) -> bool:
        return bool(
            trial.latency and trial.fp32 and trial.latency["band"][1] < trial.fp32["band"][0]
        )

    def ratio(self, trial: Trial) -> float:
        assert trial.fp32 is not None
        return trial.p50() / float(trial.fp32["p50"])

    def reason(self, trial: Trial) -> str:
        if trial.failure is not None:
            return f"failed: {trial.failure}"
        if trial.latency is None or trial.fp32 is None:
            return f"over budget: {trial.budget_reason}; not timed (a candidate within budget was)"
        speed = (
            f"{self.ratio(trial):.2f}x FP32 latency (p50 {trial.p50():.2f} ms vs "
            f"{trial.fp32['p50']:.2f} ms)"
        )
        if not self.faster(trial):  # name every criterion it fails, not the first one
            slow = f"not measurably faster than FP32: {speed}; {trial.kernels['summary']}"
            return slow if trial.budget_ok else f"over budget: {trial.budget_reason}; {slow}"
        if not self.separated(trial):
            speed += " (per-round bands overlap: a busy machine)"
        if not trial.budget_ok:
            return f"over budget: {trial.budget_reason}; {speed}"
        return f"fastest within budget: {speed}; {trial.budget_reason}"


def search(
    s: Search, tries: list[tuple[QuantSpec, PrecisionPlan]]
) -> tuple[Trial, list[Trial], SearchRecord]:
    """Build and evaluate every spec; time (interleaved with FP32) those within budget, or all of
    them when none is; mixed precision from the fastest when none qualifies.

    Returns (chosen, rejected, record)."""
    with s.timed("quantize"):
        s.trials = [s.build(spec, plan, plan.tag) for spec, plan in tries]
    with s.timed("evaluate"):
        for t in s.trials:
            s.judge(t)
    in_budget = [t for t in s.usable() if t.budget_ok]
    with s.timed("compare"):
        s.measure(in_budget or s.usable())
        if not any(t.latency for t in s.usable()):  # those within budget all failed to time
            s.measure([t for t in s.usable() if t.latency is None])
    if not any(t.latency for t in s.usable()):
        raise all_failed(s)
    good = [t for t in in_budget if s.faster(t) or s.objective == "size"]
    mixed_tried = not good and s.cfg.mixed_precision
    if mixed_tried:
        untimed = [t for t in s.usable() if t.latency is None]
        if untimed:
            with s.timed("compare"):
                s.measure(untimed)  # mixed precision starts from the fastest, in budget or not
        with s.timed("mixed_precision"):
            mixed = _mixed_precision(s)
        if mixed is not None:
            s.trials.append(mixed)
            if mixed.budget_ok and s.faster(mixed):
                good = [mixed]
    record: SearchRecord = {"fp32_latency_ms": next((t.fp32 for t in s.trials if t.fp32), None)}
    record["mixed_precision"] = s.mixed_trace
    if good:
        chosen = pick(good, s.objective, s.ctx.recipe.budget.min_gain)
    else:
        chosen = _best_effort(s)
        record["no_candidate_met_budget"] = _why_none(s)
    record["stopped"] = _stopped(s, good, mixed_tried)
    rejected = [t for t in s.trials if t is not chosen]
    return chosen, rejected, record


def pick(good: list[Trial], objective: str, min_gain: float) -> Trial:
    """The chosen one of the candidates that qualified. Objective ``size``: the smallest file.
    Objective ``latency``: the candidates that run as fast as the fastest median as far as this
    run can tell (the fastest one does not pass the pipeline's own speed test against them:
    ``min_gain`` faster at the median of per-round ratios, confirmed by separated bands or the
    sign test over the interleaved rounds) are ties; of those, the ones whose file is within
    ``min_gain`` of the smallest tie's; of those, the most faithful (mean cosine to FP32), the
    faster median breaking a tie. Which of two equally fast candidates has the lower median is
    noise; a file ``min_gain`` smaller is not, and neither is fidelity."""
    if objective == "size":
        return min(good, key=lambda t: (t.size, t.p50() if t.latency else 0.0))
    ties = latency_ties(good, min_gain)
    smallest = min(t.size for t in ties)
    small = [t for t in ties if not clearly_smaller(smallest, t.size, min_gain)]
    return max(small, key=lambda t: (t.quality.cosine_mean if t.quality else -1.0, -t.p50()))


def latency_ties(good: list[Trial], min_gain: float) -> list[Trial]:
    """The fastest median and every candidate it is not measurably faster than."""
    fastest = min(good, key=lambda t: t.p50())
    best = fastest.latency
    assert best is not None

    def as_fast(t: Trial) -> bool:
        assert t.latency is not None
        return speed_verdict(t.latency, best, min_gain)[0] != "faster"

    return [t for t in good if t is fastest or as_fast(t)]


def clearly_smaller(size: int, other: int, min_gain: float) -> bool:
    """Whether a file of ``size`` bytes is at least ``min_gain`` smaller than one of ``other``."""
    return size <= (1.0 - min_gain) * other


def _best_effort(s: Search) -> Trial:
    """Nothing qualified: the fastest-to-FP32 candidate that is at least faster, closest to budget."""
    timed = [t for t in s.usable() if t.latency is not None]
    faster = [t for t in timed if s.faster(t)] or timed
    return max(faster, key=lambda t: (t.quality.cosine_mean if t.quality else -1.0, -t.p50()))


def all_failed(s: Search) -> StepError:
    """The step's error when no trial could be built, checked, evaluated and timed: the step is
    rejected and the pipeline keeps its parent; every trial's reason is in the message."""
    reasons = " | ".join(t.failure or s.reason(t) for t in s.trials)
    return StepError(
        f"every quantized candidate failed ({len(s.trials)}): {reasons}",
        details={"candidates": [{"name": t.name, "reason": s.reason(t)} for t in s.trials]},
    )


def _stopped(s: Search, good: list[Trial], mixed_tried: bool) -> str:
    """Why the search ended where it did, for the manifest."""
    screened = [t for t in s.trials if t.screened]
    rows = (
        f" ({len(screened)} of {len(s.trials)} trials over budget on a subset of the "
        f"evaluation rows, not evaluated on the rest)"
        if screened
        else ""
    )
    if good and not mixed_tried:
        why = f"{len(good)} of {len(s.trials)} candidates faster than FP32 and within budget"
        return f"{why}; mixed precision not needed{rows}"
    if not s.cfg.mixed_precision:
        return f"no candidate faster than FP32 and within budget; mixed precision is off{rows}"
    ends = [e for e in s.mixed_trace if "result" in e or "skipped" in e]
    last: dict[str, Any] = ends[-1] if ends else {}
    why = str(last.get("result") or last.get("skipped") or "mixed precision found no plan")
    verdict = "met the budget" if good else "did not meet the budget"
    return f"mixed precision {verdict}: {why}{rows}"


def _why_none(s: Search) -> str:
    parts = [f"{t.name}: {s.reason(t)}" for t in s.trials]
    return "no candidate is both faster than FP32 and within budget; " + " | ".join(parts)


def _mixed_precision(s: Search) -> Trial | None:
    """Mixed precision from the fastest candidate that is faster than FP32 (it only costs speed)."""
    fast = sorted((t for t in s.trials if s.faster(t)), key=lambda t: t.p50())
    if not fast:
        s.mixed_trace.append({"skipped": "no candidate is faster than FP32, nothing to trade"})
        return None
    try:
        best = mixed_precision(s, fast[0])
    except Exception as err:  # the layer-wise ranking ran the model node by node, and failed
        if is_user_error(err):
            raise
        s.mixed_trace.append({"skipped": f"layer-wise error failed: {error_text(err)}"})
        return None
    if best is not None:
        s.measure([best])
    return best


def mixed_precision(s: Search, base: Trial) -> Trial | None:
    """Keep the worst nodes of ``base``'s ranking in float, bisecting over how many, until the
    budget is met (at most ``max_float_share`` of them). Returns the last probe that met it, or
    the largest probe when none did."""
    rows = layer_errors(
        s.prepared.path,
        base.path,
        base.plan.int8_nodes,
        s.eval_inputs(),
        s.cfg.layerwise_samples,
        s.ctx.threads,
        s.ctx.task.signature,
    )
    ranking = [r["node"] for r in rows if r["sqnr_db"] is not None]
    if not ranking:
        return None
    hi = max(1, int(s.cfg.max_float_share * len(ranking)))
    probes: dict[int, Trial] = {}

    def probe(k: int) -> Trial:
        nodes = [n for n in ranking[:k] if n != EMBEDDINGS]
        spec = replace(base.spec, embeddings=False) if EMBEDDINGS in ranking[:k] else base.spec
        plan = base.plan.with_float(nodes, MIXED)
        trial = s.judge(s.build(spec, plan, f"-mixed{k}"))
        probes[k] = trial
        s.mixed_trace.append(
            {
                "float_nodes": k,
                "ok": trial.budget_ok,
                "reason": trial.budget_reason,
                "fidelity": trial.quality.fidelity_dict() if trial.quality else None,
                **({"screened": trial.screened} if trial.screened else {}),
            }
        )
        return trial

    if s.cfg.impact_nodes > 0 and not probe(hi).budget_ok:
        # the float share allowed cannot reach the budget in layer-wise order: measuring each
        # node's output impact (one evaluation per node) would only reorder a lost cause
        s.mixed_trace.append(
            {
                "result": f"out of reach: even the {hi} worst-ranked of {len(ranking)} nodes "
                f"(max_float_share {s.cfg.max_float_share}) in float miss the budget; "
                "output impact not measured",
            }
        )
        return probes[hi]
    ranking = _impact_order(s, base, ranking)
    probes.clear()

    if not probe(hi).budget_ok:
        s.mixed_trace.append({"result": f"even {hi} nodes in float miss the budget"})
        return probes[hi]
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid).budget_ok:
            hi = mid
        else:
            lo = mid
    best = probes[hi]
    s.mixed_trace.append(
        {
            "result": f"{hi} of {len(ranking)} ranked nodes kept in float",
            "from": base.spec.label,
            "float_nodes_list": ranking[:hi],
        }
    )
    return best


def _impact_order(s: Search, base: Trial, ranking: list[str]) -> list[str]:
    """``ranking`` re-ordered by measured gain in the budget's cosine per cost (:mod:`.impact`)
    over its first ``impact_nodes`` nodes (and the embedding tables of a dynamic candidate that
    stores them in 8 bits); unchanged when ``impact_nodes`` is 0."""
    limit = s.cfg.impact_nodes
    if limit <= 0:
        return ranking
    measured = ranking[:limit] + ([EMBEDDINGS] if base.spec.embeddings else [])

    def progress(done: int, total: int) -> None:
        log.info("quantize: mixed precision: output impact %d/%d", done, total)

    try:
        with s.timed("impact"):
            impacts = output_impact(
                s.prepared.path,
                base.spec,
                base.plan.float_nodes,
                measured,
                lambda path: _budget_score(s, path),
                s.caches,
                "size" if s.objective == "size" else "latency",
                progress,
                budget_score(base.quality, s.ctx) if base.quality and not base.screened else None,
            )
    except Exception as err:  # a probe the quantizer or runtime refused: rank as before
        if is_user_error(err):
            raise
        s.mixed_trace.append({"impact_skipped": error_text(err)})
        return ranking
    order = rank_by_impact(ranking, impacts)
    s.mixed_trace.append(
        {
            "impact": [i.to_dict() for i in sorted(impacts, key=lambda i: -i.score)],
            "base_score": budget_score(base.quality, s.ctx) if base.quality else None,
            "order": order[: len(measured)],
        }
    )
    return order


def _budget_score(s: Search, path: Path) -> float:
    """:func:`budget_score` of the model at ``path``."""
    probe = Candidate(name="quantize:impact-probe", step="quantize", parent=None, onnx=path)
    return budget_score(s.ctx.evaluate(probe), s.ctx)


def budget_score(q: Quality, ctx: StepContext) -> float:
    """What the budget judges, as one number that grows toward FP32: the mean cosine to the
    FP32 outputs; with outputs declared by kind, the smaller margin of the declared agreement
    over ``min_agreement`` and of the other outputs' cosine over ``min_cosine``."""
    if q.agreement is None:
        return float(q.cosine_mean)
    b = ctx.recipe.budget
    margins = [q.agreement - b.min_agreement]
    if q.cosine_judged is not None:
        margins.append(q.cosine_judged - b.min_cosine)
    return float(min(margins))


def describe(s: Search, trial: Trial, rows: list[dict[str, Any]]) -> TrialDescription:
    """The record of one trial for ``Candidate.meta``."""
    return {
        "config": trial.spec.to_dict(),
        "label": trial.label,
        "precision_map": trial.plan.to_dict(),
        "kernels": trial.kernels,
        "fallback_report": trial.kernels["summary"],
        "layerwise": rows,
        "layerwise_statement": error_statement(rows) if rows else None,
        "latency_ratio_vs_fp32": round(s.ratio(trial), 4) if trial.latency and trial.fp32 else None,
        "notes": trial.notes,
    }


def layerwise_for(s: Search, trial: Trial) -> list[dict[str, Any]]:
    return layer_errors(
        s.prepared.path,
        trial.path,
        trial.plan.int8_nodes,
        s.eval_inputs(),
        s.cfg.layerwise_samples,
        s.ctx.threads,
        s.ctx.task.signature,
    )
