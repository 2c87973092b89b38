"""How a run measures a candidate, the same way for a step's own search, the accept/reject
verdict and the final figures: quality (task metric and fidelity, evaluated once per ONNX file
and runtime), latency compared interleaved, file size and parameter count, and the key a cached
measurement depends on. :func:`step_context` hands this measurement to a step: a step's
``ctx.evaluate``, ``ctx.compare`` and ``ctx.evaluate_rows`` land here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..candidate import Candidate, artifact_size, is_ir
from ..context import StepContext
from ..measure.latency import (
    Retire,
    Until,
    benchmark,
    cannot_be_faster,
    decisively_faster,
    settled_verdict,
)
from ..measure.quality import Quality, evaluate
from ..measure.runners import make_runner
from ..record import package_versions
from .state import Run

__all__ = [
    "compare",
    "file_size",
    "measure_key_parts",
    "param_count",
    "planned_rounds",
    "quality_of",
    "quality_of_rows",
    "settled_pooled",
    "settled_slower",
    "step_context",
]

# bump when how candidates are measured or judged changes: cached figures and decisions miss
# 2: decision benchmarks run about 1 s per candidate per round; 3: a throughput size is warmed in
# its first round only, a call past the minimum is one sample; peak RSS over 3 runs, not 5
MEASURE_VERSION = 3
MEASURE_PACKAGES = ("onnxruntime", "torch", "numpy", "openvino")


def step_context(run: Run, workdir: Path) -> StepContext:
    """The context the pipeline gives a step of ``run`` that writes into ``workdir``: the run's
    baseline, reference outputs, cache and data hashes, and its measurement."""
    assert run.reference is not None
    baseline = next((c for c in run.chain if c.name == "fp32-onnx"), run.chain[0])
    return StepContext(
        task=run.task,
        recipe=run.recipe,
        workdir=workdir,
        baseline=baseline,
        reference=run.reference,
        cache=run.cache,
        data_hashes=run.hashes,
        evaluate_fn=lambda c: quality_of(run, c),
        compare_fn=lambda cs: compare(run, cs),
        evaluate_rows_fn=lambda c, rows: quality_of_rows(run, c, rows),
        compare_retiring_fn=lambda cs, retire: compare(run, cs, retire=retire),
    )


def quality_of(run: Run, cand: Candidate, runtime: str | None = None) -> Quality:
    """Metric and fidelity of ``cand`` on ``runtime`` (default: the run's first runtime). An
    ONNX file is evaluated once per runtime in a run (the same file on the same runtime and
    data gives the same outputs); a failure is not kept, so it is raised again where asked."""
    assert run.reference is not None
    rt = runtime or run.runtimes[0]
    key = (cand.content_hash(), rt) if cand.onnx is not None else None
    if key is not None and key in run.qualities:
        return run.qualities[key]
    runner = make_runner(cand, run.threads, run.task.signature, rt)
    quality = evaluate(runner, run.task, run.reference, run.recipe.bench.eval_limit)
    if key is not None:
        run.qualities[key] = quality
    return quality


def quality_of_rows(run: Run, cand: Candidate, rows: int) -> Quality | None:
    """Metric and fidelity of ``cand`` on the first ``rows`` evaluation rows, on the run's first
    runtime, against FP32's on those rows (:func:`~slimline.measure.screen.subset_reference`)."""
    from ..measure.screen import subset_reference

    assert run.reference is not None
    ref = subset_reference(run.reference, run.task, rows)
    if ref is None:
        return None
    runner = make_runner(cand, run.threads, run.task.signature, run.runtimes[0])
    return evaluate(runner, run.task, ref, rows)


def compare(
    run: Run,
    cands: list[Candidate],
    rounds: int | None = None,
    runtime: str | None = None,
    until: Until | None = None,
    retire: Retire | None = None,
) -> dict[str, dict[str, Any]]:
    sample = run.task.sample_inputs(1)
    bench = run.recipe.bench
    return benchmark(
        cands,
        sample,
        bench.model_copy(update={"rounds": rounds}) if rounds else bench,
        run.threads,
        throughput=False,
        desc="compare " + " vs ".join(c.name for c in cands),
        signature=run.task.signature,
        runtimes=[runtime or run.runtimes[0]],
        until=until,
        retire=retire,
        decision=True,
    )


def settled_slower(run: Run, parent: Candidate, cand: Candidate) -> Until:
    """Stops a parent-vs-candidate comparison as soon as its verdict can only be ``not faster``
    (:func:`~slimline.measure.latency.cannot_be_faster`): a clear rejection costs about half
    the rounds, and every verdict stays what all the rounds would have given; or as soon as the
    candidate wins every round by far with the bands apart
    (:func:`~slimline.measure.latency.decisively_faster`)."""
    rounds, gain = run.recipe.bench.rounds, run.recipe.budget.min_gain

    def until(p50s: dict[str, list[float]]) -> bool:
        p, c = p50s[parent.name], p50s[cand.name]
        return cannot_be_faster(p, c, rounds, gain) or decisively_faster(p, c, rounds, gain)

    return until


def planned_rounds(run: Run) -> int:
    return int(run.recipe.bench.rounds)


def settled_pooled(
    run: Run, parent: Candidate, cand: Candidate, first_p: dict[str, Any], first_c: dict[str, Any]
) -> Until:
    """Stops the second, twice-as-long comparison of an inconclusive verdict as soon as the
    verdict over all rounds (the first comparison's and this one's, paired by round) is settled
    either way (:func:`~slimline.measure.latency.settled_verdict`): the verdict stays what all
    the rounds would have given; only rounds that could not change it are skipped."""
    total, gain = 3 * planned_rounds(run), run.recipe.budget.min_gain
    p0, c0 = list(first_p["per_round_p50"]), list(first_c["per_round_p50"])

    def until(p50s: dict[str, list[float]]) -> bool:
        p, c = [*p0, *p50s[parent.name]], [*c0, *p50s[cand.name]]
        return settled_verdict(p, c, total, gain) is not None

    return until


def file_size(c: Candidate) -> int | None:
    return artifact_size(c.onnx) if c.onnx is not None else None


def param_count(c: Candidate) -> int | None:
    if c.onnx is not None and is_ir(c.onnx):
        from ..measure.ov import ov_param_count

        return ov_param_count(Path(c.onnx))
    if c.onnx is not None:
        import onnx

        model = onnx.load(str(c.onnx), load_external_data=False)
        return int(sum(int(np.prod(t.dims)) for t in model.graph.initializer))
    if c.module is not None:
        return int(sum(p.numel() for p in c.module.parameters()))
    return None


def measure_key_parts(run: Run) -> dict[str, Any]:
    """What a measurement or an accept/reject decision depends on besides the models."""
    r = run.recipe
    return {
        "measure_version": MEASURE_VERSION,
        "packages": package_versions(MEASURE_PACKAGES),
        "target": r.target.key_dict(),
        "budget": r.budget.key_dict(),
        **({"judging": r.judging()} if r.outputs or r.metric else {}),
        "bench": r.bench.key_dict(),
    }
