"""One quantized variant of the automatic mode (:class:`Trial`) and what the search does with
each (:class:`Search`): build and check it, judge its quality against the budget (on a subset
of the rows first), time it interleaved with FP32, and say why it was or was not chosen. A
failure at any stage rejects that trial with its reason, never the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...candidate import Candidate
from ...context import StepContext
from ...errors import error_text, is_user_error
from ...measure.latency import median_cannot_win
from ...measure.quality import Quality
from ...measure.runners import check_candidate
from ...measure.screen import best_case, can_screen
from ...task import Inputs
from .config import QuantizeConfig, QuantSpec
from .engine import quantize_model
from .fallback import fallback_warning, kernel_report
from .layerwise import layer_errors
from .plan import PrecisionPlan
from .prepare import Prepared

__all__ = ["SCREEN_MIN_ROWS", "Search", "Trial"]

log = logging.getLogger("slimline.quantize")


SCREEN_MIN_ROWS = 8  # screening evaluates a quarter of the rows, at least this many
# Trials timed only to rank them (none is within budget: the timing chooses mixed precision's
# starting file and names the closest miss, and decides no verdict) run this many rounds at most.
RANK_ROUNDS = 3


NOT_BUILT: dict[str, Any] = {
    "int8_kernels": 0,
    "compute_kernels": 0,
    "summary": "not built",
    "int8_share": 0.0,
    "fallback": [],
    "float_by_choice": 0,
    "kernels": {},
}


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
    timing_stopped: str | None = None  # left out of later timing rounds: the rounds, and why
    cpu_p50: tuple[float, float] | None = None  # CPU ms per run, the trial's and FP32's
    not_timed: str | None = None  # why a trial built after the first timing was not timed
    # timed before calibrating on all rows and slower than FP32 at any ranges (.speed_check):
    # recorded with that timing, never evaluated, built on again or chosen
    slow_at_any_range: str | None = None

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
    layer_rows: dict[Path, list[dict[str, Any]]] = field(default_factory=dict)
    layerwise_skipped: str | None = None  # why the chosen trial's table was not measured
    # ranges for calibration methods not run up front: method names -> their cache files
    calibrate_more: Callable[[set[str]], dict[str, Path]] | None = None
    recalibration: dict[str, Any] = field(default_factory=dict)  # the near-miss follow-up
    slow_statics: list[Trial] = field(default_factory=list)  # set aside by .speed_check

    def layer_errors(self, trial: Trial) -> list[dict[str, Any]]:
        """``trial``'s layer-wise error (:func:`.layerwise.layer_errors`), measured once per
        file in a search: mixed precision ranks by it, and the step's record keeps it for the
        chosen trial, which is often the same one."""
        if trial.path not in self.layer_rows:
            self.layer_rows[trial.path] = layer_errors(
                self.prepared.path,
                trial.path,
                trial.plan.int8_nodes,
                self.eval_inputs(),
                self.cfg.layerwise_samples,
                self.ctx.threads,
                self.ctx.task.signature,
            )
        return self.layer_rows[trial.path]

    @contextmanager
    def timed(self, what: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[what] = round(self.timings.get(what, 0.0) + time.perf_counter() - t0, 3)

    def build(
        self, spec: QuantSpec, plan: PrecisionPlan, tag: str = "", where: Path | None = None
    ) -> Trial:
        """Write one variant (into ``where``, by default the search's folder) and check it
        (``onnx.checker`` plus an ONNX Runtime load); a failure rejects this trial with its
        reason, never the step."""
        trial = Trial(spec, plan, (where or self.out_dir) / f"{spec.slug}{tag}.onnx")
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
        """The trials the search can still judge, time, build on or choose."""
        return [t for t in self.trials if t.failure is None and t.slow_at_any_range is None]

    def candidate(self, trial: Trial, parent: str = "") -> Candidate:
        return Candidate(name=trial.name, step="quantize", parent=parent or None, onnx=trial.path)

    def measure(self, trials: list[Trial], *, rank_only: bool = False) -> None:
        """Time ``trials`` interleaved with FP32. When that fails, each is timed alone with FP32
        so that one trial's failure rejects that trial only. ``rank_only``: the trials are over
        budget and timed only to rank them; at most :data:`RANK_ROUNDS` rounds."""
        trials = [t for t in trials if t.failure is None]
        if not trials:
            return
        try:
            self._time(trials, rank_only)
        except Exception as err:
            if is_user_error(err) or len(trials) == 1:
                self.fail(trials[0], "timing", err)
                return
            for t in trials:
                try:
                    self._time([t], rank_only)
                except Exception as one:
                    self.fail(t, "timing", one)

    def _time(self, trials: list[Trial], rank_only: bool = False) -> None:
        """One interleaved benchmark of ``trials`` with FP32. A trial whose median can no longer
        beat FP32's by ``min_gain``, whatever the rounds still to run give
        (:func:`~slimline.measure.latency.median_cannot_win`), is left out of the later rounds:
        it cannot be faster (:meth:`faster`), so it cannot be chosen for speed; its figures
        cover the rounds it ran, and ``timing_stopped`` says why. ``rank_only``: every trial
        stops after :data:`RANK_ROUNDS` rounds (their figures rank them; no verdict reads them)."""
        base = self.ctx.baseline
        rounds, gain = self.ctx.recipe.bench.rounds, self.ctx.recipe.budget.min_gain
        names = {t.name for t in trials}
        rank_at = min(RANK_ROUNDS, rounds) if rank_only else rounds

        def retire(p50s: dict[str, list[float]]) -> list[str]:
            if len(p50s.get(base.name) or []) >= rank_at:
                return sorted(names)  # ranked: FP32 alone is left, so the benchmark ends
            return [
                n
                for n in names
                if n in p50s and median_cannot_win(p50s[base.name], p50s[n], rounds, gain)
            ]

        figures = self.ctx.compare_retiring([base, *[self.candidate(t) for t in trials]], retire)
        for t in trials:
            t.latency, t.fp32 = figures[t.name]["latency_ms"], figures[base.name]["latency_ms"]
            cpu, fp32_cpu = figures[t.name].get("cpu_ms"), figures[base.name].get("cpu_ms")
            if cpu and fp32_cpu:
                t.cpu_p50 = (float(cpu["p50"]), float(fp32_cpu["p50"]))
            ran = int(t.latency.get("rounds", rounds))
            if rank_only and ran == rank_at < rounds:
                t.timing_stopped = (
                    f"timed {ran} of {rounds} rounds: no trial was within budget, so the timing "
                    "only ranks them (mixed precision starts from the fastest)"
                )
            elif ran < rounds:
                t.timing_stopped = (
                    f"timed {ran} of {rounds} rounds: its median could no longer beat FP32's by "
                    f"{gain:.0%} whatever the later rounds gave"
                )

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
        if trial.slow_at_any_range is not None:
            return f"not faster than FP32 at any ranges: {trial.slow_at_any_range}"
        if trial.latency is None or trial.fp32 is None:
            why = trial.not_timed or (
                "mixed precision's probe missed it"
                if trial.plan.tag.startswith("-mixed")
                else ("a candidate within budget was")
            )
            return f"over budget: {trial.budget_reason}; not timed ({why})"
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
