"""What a step sees while it runs: the task, the recipe, where to write, and how to measure.

A step handler is ``fn(config, candidate, ctx) -> candidate``. It writes its artifacts under
``ctx.workdir`` (that directory becomes the step's cache entry, so it must hold everything the
returned candidates point to). A step that tries several variants returns the one it picked and
appends the others to ``ctx.alternatives`` with ``accepted=False`` and a measured ``reason``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cache import StepCache
from .candidate import Candidate, is_ir, quantizable_graph
from .config import StepConfig
from .cpu import detect as detect_cpu
from .paths import cache_dir
from .recipe import Recipe
from .record import atomic_write_bytes, data_hash, json_hash, package_versions
from .steps import spec_for
from .task import Task
from .tensors import FROZEN_KEY, frozen_inputs, frozen_to_json

if TYPE_CHECKING:
    from .measure.quality import Quality, Reference

__all__ = [
    "Compare",
    "CompareRetiring",
    "Evaluate",
    "EvaluateRows",
    "StepContext",
    "step_key_parts",
]

# Task metric and fidelity of a candidate against the FP32 reference outputs.
Evaluate = Callable[[Candidate], "Quality"]
# The same on the first rows of the evaluation data only (see StepContext.evaluate_rows).
EvaluateRows = Callable[[Candidate, int], "Quality | None"]
# Latency of candidates timed interleaved, keyed by name (see StepContext.compare).
Compare = Callable[[list[Candidate]], dict[str, dict[str, Any]]]
# The same, leaving out of later rounds the names the callback returns after each round (their
# verdict is settled; see slimline.measure.latency.Retire).
CompareRetiring = Callable[
    [list[Candidate], Callable[[dict[str, list[float]]], Any]], dict[str, dict[str, Any]]
]


def step_key_parts(
    cfg: StepConfig,
    input_hash: str,
    task: Task,
    data: dict[str, str],
    recipe: Recipe | None = None,
) -> dict[str, Any]:
    """What a result of step ``cfg`` depends on besides its config: the step's own version, the
    packages it uses, its input, the task and its data, and (with ``recipe``) the recipe fields
    the step declares it reads. Not slimline's other source files."""
    spec = spec_for(cfg)
    parts: dict[str, Any] = {
        "step": cfg.kind,
        "step_version": spec.version,
        "packages": package_versions(spec.packages),
        "input": input_hash,
        "task": task.source,
        "data": data,
        # INT8 kernels, the candidate set and training numerics differ by CPU kind
        "cpu": detect_cpu().kind,
    }
    if recipe is not None:
        parts["recipe"] = recipe.read(spec.reads)
    return parts


@dataclass
class StepContext:
    task: Task
    recipe: Recipe
    workdir: Path
    baseline: Candidate  # fp32-onnx: the reference every ratio is taken against
    reference: Reference  # FP32 outputs on the evaluation data
    alternatives: list[Candidate] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # the pipeline's cache and the task's data hashes (a context built without them makes its own)
    cache: StepCache | None = None
    data_hashes: dict[str, str] = field(default_factory=dict)
    # how steps measure: the pipeline passes its own measurement (so do slimline.api's
    # contexts by default); a context without ``compare_fn`` has no benchmark, and steps skip
    # their optional timings
    evaluate_fn: Evaluate | None = None
    compare_fn: Compare | None = None
    evaluate_rows_fn: EvaluateRows | None = None
    compare_retiring_fn: CompareRetiring | None = None
    # inputs frozen into the step's input candidate (see for_candidate)
    frozen: dict[str, Any] = field(default_factory=dict)

    @property
    def threads(self) -> int:
        return self.recipe.target.threads

    def for_candidate(self, cand: Candidate) -> StepContext:
        """This context for a step on ``cand``: where the graph step froze inputs into it, the
        task's data and signature without them (the step's tools feed the graph directly)."""
        if cand.onnx is None or is_ir(cand.onnx):
            return self
        frozen = frozen_inputs(quantizable_graph(cand))
        if not frozen:
            return self
        return replace(self, task=self.task.without_inputs(frozen), frozen=frozen)

    def keep_frozen(self, cands: list[Candidate]) -> None:
        """Record the input's frozen inputs in each ONNX file a step wrote anew without them
        (so runners and the server still drop them from feeds that carry them)."""
        for c in cands:  # only the step's own files: an earlier entry's file stays as it is
            if self.frozen and c.onnx is not None and self._writes(Path(c.onnx)):
                record_frozen(c.onnx, self.frozen)

    def _writes(self, path: Path) -> bool:
        return path.resolve().is_relative_to(self.workdir.resolve())

    def step_cache(self) -> StepCache:
        """Where a step keeps results and resumable state beyond its own cache entry."""
        if self.cache is None:
            self.cache = StepCache(cache_dir())
        return self.cache

    def cache_key(self, cfg: StepConfig, cand: Candidate, **extra: Any) -> str:
        """Key of a result of ``cfg`` on ``cand`` that depends on ``extra`` (not the config or
        the recipe fields unless passed in ``extra``): see :func:`step_key_parts`."""
        if not self.data_hashes:
            self.data_hashes = {
                "calibration_data": data_hash(self.task.calibration_data()),
                "eval_data": data_hash(self.task.eval_data()),
            }
        parts = step_key_parts(cfg, cand.content_hash(), self.task, self.data_hashes)
        return json_hash({**parts, **extra})

    def evaluate(self, cand: Candidate) -> Quality:
        """Task metric and fidelity of ``cand`` against the FP32 reference outputs."""
        assert self.evaluate_fn is not None, "this StepContext was built without evaluate_fn"
        return self.evaluate_fn(cand)

    def evaluate_rows(self, cand: Candidate, rows: int) -> Quality | None:
        """Quality of ``cand`` on the first ``rows`` evaluation rows against FP32's on the same
        rows; None where the context cannot cut the evaluation (no ``evaluate_rows_fn``, or
        labels that are not an array of rows)."""
        return self.evaluate_rows_fn(cand, rows) if self.evaluate_rows_fn is not None else None

    def compare(self, cands: list[Candidate]) -> dict[str, dict[str, Any]]:
        """Latency of ``cands`` measured interleaved (A B C A B C ...), keyed by name.

        Each value has ``latency_ms`` = {p50, p95, p99, mean, band: [lo, hi]}.
        """
        assert self.compare_fn is not None, "this StepContext was built without compare_fn"
        return self.compare_fn(cands)

    def compare_retiring(
        self, cands: list[Candidate], retire: Callable[[dict[str, list[float]]], Any]
    ) -> dict[str, dict[str, Any]]:
        """:meth:`compare`, leaving out of later rounds the names ``retire`` returns after each
        round (given the per-round p50s so far); a context without ``compare_retiring_fn``
        times every candidate in every round."""
        if self.compare_retiring_fn is None:
            return self.compare(cands)
        return self.compare_retiring_fn(cands, retire)

    def within_budget(self, quality: Quality) -> tuple[bool, str]:
        """(ok, reason) for ``quality`` against the recipe's budget and the FP32 metric: the
        metric drop, ``min_agreement`` on the declared outputs, ``min_cosine`` on the others."""
        b = self.recipe.budget
        if quality.metric_error is not None:
            return False, quality.metric_error
        drop = self.reference.metric - quality.metric
        # declared outputs judge fidelity: the cosine an ONNX task has for a metric does not
        by_kind = quality.declared is not None and self.task.metric_is_fidelity
        if drop > b.max_metric_drop and not by_kind:
            return False, (
                f"metric drop {drop:.4f} > budget {b.max_metric_drop:.4f} "
                f"({self.task.metric_name} {quality.metric:.4f} vs FP32 {self.reference.metric:.4f})"
            )
        if quality.agreement is not None and not quality.agreement >= b.min_agreement:
            return False, (
                f"agreement {quality.agreement:.4f} < budget {b.min_agreement:.4f} "
                f"({quality.declared_text()})"
            )
        cos = quality.cosine_judged
        if cos is not None and cos < b.min_cosine:
            return False, f"mean cosine {cos:.4f} < budget {b.min_cosine:.4f}"
        if quality.agreement is None:
            return True, f"within budget (drop {drop:.4f}, cosine {quality.cosine_mean:.4f})"
        shown = "" if by_kind else f"drop {drop:.4f}; "
        return True, f"within budget ({shown}{quality.declared_text()})"

    def warn(self, message: str) -> None:
        import logging

        logging.getLogger("slimline").warning(message)
        self.warnings.append(message)


def record_frozen(path: Path | str, frozen: dict[str, Any]) -> bool:
    """Record ``frozen`` in an ONNX file that lacks the record but was built without those
    inputs (a step that writes its graph anew, e.g. a QAT export of a frozen graph); True if
    written (atomically). A file that still takes one of them is left alone."""
    import onnx

    path = Path(path)
    if not frozen or path.suffix != ".onnx" or frozen_inputs(path):
        return False
    model = onnx.load(str(path), load_external_data=False)
    if any(i.name in frozen for i in model.graph.input):
        return False
    model.metadata_props.add(key=FROZEN_KEY, value=frozen_to_json(frozen))
    atomic_write_bytes(path, model.SerializeToString())
    return True
