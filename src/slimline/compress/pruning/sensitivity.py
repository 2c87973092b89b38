"""Sensitivity map: each prunable group pruned alone at several ratios, metric measured on a
fixed evaluation subset.

Every (group, ratio) job is independent, so the sweep runs on a process pool (spawned workers,
one torch thread each) or, when the recipe names a cluster, on Ray actors
(``ray.init(address=...)``). A job carries only the channel indices to remove: the importance
ranking is computed once, in the parent, so workers do no gradient work and agree on the order.

A sweep can take many minutes on a large model, so its total is estimated from its first jobs
(two per worker) and announced, with the settings that shorten it, when it exceeds
:data:`SLOW_SWEEP_SECONDS`; the table records the estimate next to the time it took.
"""

from __future__ import annotations

import copy
import io
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import DataError, StepError
from ...measure.quality import fidelity
from ...module_guard import private_copy
from ...task import Task, iter_rows, load_task
from ..finetune import to_tensors, trim_padding
from .depth import replay_history
from .graph import PruneGraph, keep_units, prune_channels

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import Tensor, nn

__all__ = [
    "SLOW_SWEEP_SECONDS",
    "Job",
    "SweepEstimate",
    "SweepSpec",
    "build_jobs",
    "run_sweep",
    "table_losses",
]

log = logging.getLogger("slimline.prune")
SLOW_SWEEP_SECONDS = 300.0  # a sweep estimated to take longer is announced before it goes on
_clock = time.perf_counter  # module-level so tests can drive the timing with a fake clock


@dataclass(frozen=True)
class Job:
    group: str
    keep: int
    root: str  # layer whose output channels are removed
    idxs: tuple[int, ...]


@dataclass
class SweepSpec:
    """What a worker needs to rebuild the input model and the evaluation subset (picklable)."""

    task_source: str
    task_samples: str | None
    history: list[list[Any]]  # applied to task.model() to get the input model's architecture
    state: bytes  # torch.save of the input model's state_dict
    eval_limit: int
    threads: int = 1
    example: dict[str, np.ndarray] = field(default_factory=dict)


def build_jobs(
    graph: PruneGraph, order: dict[str, list[int]], ratios: list[float], max_ratio: float
) -> tuple[list[Job], dict[str, list[int]]]:
    """Unique jobs (one per distinct kept count) and each group's kept count per ratio."""
    jobs: list[Job] = []
    keeps: dict[str, list[int]] = {}
    for name, g in graph.groups.items():
        keeps[name] = [keep_units(g.size, r, g.kind, graph.round_to, max_ratio) for r in ratios]
        for keep in sorted(set(keeps[name]) - {g.size}, reverse=True):
            root, idxs = graph.channels(name, order[name][: g.size - keep])
            jobs.append(Job(name, keep, root, tuple(idxs)))
    return jobs, keeps


def _eval_batches(task: Task, limit: int) -> list[tuple[dict[str, np.ndarray], Any]]:
    out: list[tuple[dict[str, np.ndarray], Any]] = []
    seen = 0
    for inputs, labels in task.eval_data():
        n = len(next(iter(inputs.values())))
        keep = min(n, limit - seen)
        if keep < n:
            inputs = next(iter_rows([inputs], keep))
            labels = labels[:keep] if labels is not None else None
        out.append((inputs, labels))
        seen += keep
        if seen >= limit:
            break
    if not out:
        raise DataError(
            f"task {task.name}: eval_data() yielded nothing; the sensitivity sweep needs it"
        )
    return out


def _concat_labels(labels: list[Any]) -> Any:
    if all(lab is None for lab in labels):
        return None
    try:
        return np.concatenate([np.asarray(lab) for lab in labels])
    except ValueError:
        return labels


class Evaluator:
    """Prunes a copy of the model per job and measures metric and cosine on the subset."""

    def __init__(
        self, model: nn.Module, task: Task, limit: int, example: dict[str, Tensor]
    ) -> None:
        self.model = model.eval()
        self.task = task
        self.example = example
        self.batches = _eval_batches(task, limit)
        self.labels = _concat_labels([lab for _, lab in self.batches])
        self.reference = self._outputs(self.model)
        self.base_metric = float(task.metric(self.reference, self.labels))

    def _outputs(self, model: nn.Module) -> np.ndarray:
        import torch

        outs = []
        with torch.inference_mode():
            for inputs, _ in self.batches:
                out = model(**to_tensors(trim_padding(inputs)))
                out = out[0] if isinstance(out, (tuple, list)) else out
                outs.append(out.detach().float().numpy())
        return np.concatenate(outs)

    @property
    def samples(self) -> int:
        return sum(len(next(iter(b.values()))) for b, _ in self.batches)

    def score(self, model: nn.Module) -> dict[str, float]:
        """Task metric and mean cosine to the unpruned outputs of ``model`` on the subset."""
        outputs = self._outputs(model)
        fid = fidelity(outputs, self.reference, self.task.output_kind == "logits")
        return {
            "metric": float(self.task.metric(outputs, self.labels)),
            "cosine": float(fid["cosine_mean"] or 0.0),
        }

    def run(self, job: Job) -> dict[str, Any]:
        start = _clock()
        model = copy.deepcopy(self.model)
        prune_channels(model, self.example, job.root, list(job.idxs))
        score = self.score(model.eval())
        return {"group": job.group, "keep": job.keep, **score, "seconds": _clock() - start}


# -- worker side -------------------------------------------------------------------------------
_WORKER: Evaluator | None = None


def _rebuild(spec: SweepSpec) -> Evaluator:
    import torch

    torch.set_num_threads(spec.threads)
    task = load_task(spec.task_source, spec.task_samples)
    if task.model is None:
        raise StepError(
            f"task {task.name} has no model(); the sensitivity sweep needs a torch model"
        )
    example = to_tensors(spec.example)
    # a copy: model() may hand out one shared object, and the history prunes in place
    model = replay_history(private_copy(task.model()).eval(), example, spec.history)
    model.load_state_dict(torch.load(io.BytesIO(spec.state), weights_only=True))
    return Evaluator(model, task, spec.eval_limit, example)


def _init_worker(spec: SweepSpec) -> None:
    global _WORKER
    logging.getLogger("slimline").setLevel(logging.WARNING)
    _WORKER = _rebuild(spec)


def _run_job(job: Job) -> dict[str, Any]:
    assert _WORKER is not None, "worker not initialised"
    return _WORKER.run(job)


class _RayWorker:
    def __init__(self, spec: SweepSpec) -> None:
        self.evaluator = _rebuild(spec)

    def run(self, job: Job) -> dict[str, Any]:
        return self.evaluator.run(job)


# -- backends ----------------------------------------------------------------------------------
def _sequential(
    evaluator: Evaluator, jobs: list[Job], finished: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    results = []
    for job in jobs:
        results.append(evaluator.run(job))
        finished(results[-1])
    return results


def _process_pool(
    spec: SweepSpec, jobs: list[Job], workers: int, finished: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    import multiprocessing as mp

    results = []
    with ProcessPoolExecutor(
        max_workers=workers,
        mp_context=mp.get_context("spawn"),
        initializer=_init_worker,
        initargs=(spec,),
    ) as pool:
        for res in pool.map(_run_job, jobs):
            results.append(res)
            finished(res)
    return results


def _ray(
    spec: SweepSpec, jobs: list[Job], address: str, estimate: SweepEstimate
) -> list[dict[str, Any]]:
    import ray
    from ray.util import ActorPool

    connected_here = not ray.is_initialized()
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    actors: list[Any] = []
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))  # type: ignore[no-untyped-call]
        spec_ref = ray.put(spec)
        actor_cls = ray.remote(num_cpus=1)(_RayWorker)
        actors = [actor_cls.remote(spec_ref) for _ in range(max(1, min(cpus, len(jobs))))]
        estimate.parallel = len(actors)
        results = []
        for res in ActorPool(actors).map_unordered(lambda a, j: a.run.remote(j), jobs):
            results.append(res)
            estimate.finished(res)
        return results
    finally:  # on success and on failure: the sweep's actors never outlive it
        for a in actors:
            ray.kill(a)
        if connected_here:
            ray.shutdown()


def run_sweep(
    graph: PruneGraph,
    order: dict[str, list[int]],
    evaluator: Evaluator,
    *,
    ratios: list[float],
    max_ratio: float,
    spec: SweepSpec | None,
    workers: int,
    ray_address: str | None,
    progress: bool = True,
) -> dict[str, Any]:
    """The layer x ratio table: metric and cosine of each group pruned alone at each ratio."""
    from tqdm.auto import tqdm

    jobs, keeps = build_jobs(graph, order, ratios, max_ratio)
    samples = sum(len(next(iter(b.values()))) for b, _ in evaluator.batches)
    pool = workers > 1 and spec is not None and len(jobs) > 1
    backend = (
        f"ray({ray_address})"
        if ray_address
        else f"process-pool({workers})"
        if pool
        else "in-process"
    )
    bar = tqdm(total=len(jobs), desc="sensitivity", disable=not progress, leave=False)
    estimate = SweepEstimate(
        len(jobs),
        workers if pool else 1,
        backend=backend,
        hint=_shorter_sweep_hint(samples, len(ratios), workers),
        on_job=lambda: bar.update(1),
    )
    if ray_address:
        if spec is None:
            raise StepError(
                "a Ray sweep needs a task loadable by its source (an example name or a .py file)"
            )
        results = _ray(spec, jobs, ray_address, estimate)
    elif pool:
        assert spec is not None
        results = _process_pool(spec, jobs, workers, estimate.finished)
    else:
        results = _sequential(evaluator, jobs, estimate.finished)
    bar.close()
    seconds = estimate.elapsed()
    table = _table(graph, keeps, results, evaluator.base_metric, ratios, backend, seconds, samples)
    return {**table, "estimate": estimate.to_dict()}


def _shorter_sweep_hint(samples: int, ratios: int, workers: int) -> str:
    return (
        f"to shorten it, lower `sensitivity_samples` (now {samples} rows) or use fewer `ratios` "
        f"(now {ratios}), raise `round_to` or `exclude` layers (fewer distinct jobs), raise "
        f"`workers` (now {workers}) or set `ray_address`; or skip the sweep with `plan:` "
        "copied from an earlier run's manifest"
    )


class SweepEstimate:
    """The total time of a sweep, estimated once its first jobs are done, and announced when it
    exceeds ``limit`` seconds.

    The first two waves of jobs are timed (two per worker, each job reports its own
    ``seconds``). The estimate is the time so far plus the remaining jobs at the second wave's
    mean time, spread over the workers: the first wave also pays for warming up (worker start,
    first-run kernel setup), which once measured 4x a steady job.
    """

    def __init__(
        self,
        jobs: int,
        parallel: int,
        *,
        backend: str,
        hint: str,
        on_job: Callable[[], None] | None = None,
        limit: float = SLOW_SWEEP_SECONDS,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.jobs, self.parallel, self.backend, self.hint = jobs, max(1, parallel), backend, hint
        self.on_job, self.limit = on_job, limit
        self.clock = clock or _clock
        self.start = self.clock()
        self.job_seconds: list[float] = []
        self.seconds: float | None = None  # the estimate, once made
        self.message: str | None = None  # what was announced, if the sweep is long

    def finished(self, result: dict[str, Any]) -> None:
        self.job_seconds.append(float(result.get("seconds", 0.0)))
        if self.on_job is not None:
            self.on_job()
        if self.seconds is None and len(self.job_seconds) >= self.sample_jobs:
            self._estimate()

    @property
    def sample_jobs(self) -> int:
        return min(2 * self.parallel, self.jobs)

    def _steady_job_seconds(self) -> float:
        steady = self.job_seconds[self.parallel : self.sample_jobs] or self.job_seconds
        return sum(steady) / len(steady)

    def elapsed(self) -> float:
        return self.clock() - self.start

    def _estimate(self) -> None:
        done = len(self.job_seconds)
        per_job = self._steady_job_seconds()
        self.seconds = self.elapsed() + per_job * (self.jobs - done) / self.parallel
        if self.seconds <= self.limit:
            log.info("sensitivity map: %d jobs, about %.0f s", self.jobs, self.seconds)
            return
        self.message = (
            f"sensitivity sweep: {self.jobs} jobs will take about {_minutes(self.seconds)} "
            f"(estimated from the first {done}: {per_job:.1f} s a job, {self.backend}); "
            f"{self.hint}"
        )
        log.warning(self.message)

    def to_dict(self) -> dict[str, Any]:
        per_job = self._steady_job_seconds() if self.job_seconds else None
        return {
            "seconds": None if self.seconds is None else round(self.seconds, 2),
            "from_jobs": self.sample_jobs,
            "job_seconds": None if per_job is None else round(per_job, 3),
            "limit_seconds": self.limit,
            "announced": self.message,
        }


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _table(
    graph: PruneGraph,
    keeps: dict[str, list[int]],
    results: Iterable[dict[str, Any]],
    base: float,
    ratios: list[float],
    backend: str,
    seconds: float,
    samples: int,
) -> dict[str, Any]:
    by_key = {(r["group"], r["keep"]): r for r in results}
    groups = {}
    for name, g in graph.groups.items():
        rows = [by_key.get((name, k), {"metric": base, "cosine": 1.0}) for k in keeps[name]]
        groups[name] = {
            "kind": g.kind,
            "size": g.size,
            "keep": keeps[name],
            "metric": [round(r["metric"], 6) for r in rows],
            "cosine": [round(r["cosine"], 6) for r in rows],
        }
    return {
        "ratios": ratios,
        "base_metric": base,
        "samples": samples,
        "backend": backend,
        "seconds": round(seconds, 2),
        "jobs": len(by_key),
        "groups": groups,
    }


def table_losses(table: dict[str, Any], fidelity_weight: float) -> dict[str, list[float]]:
    """Predicted loss per group and ratio: metric drop plus ``fidelity_weight`` x (1 - cosine),
    made non-decreasing in the ratio (removing more never predicts less loss)."""
    base = table["base_metric"]
    out = {}
    for name, row in table["groups"].items():
        raw = [
            max(0.0, base - m) + fidelity_weight * max(0.0, 1.0 - c)
            for m, c in zip(row["metric"], row["cosine"], strict=True)
        ]
        out[name] = (
            list(np.maximum.accumulate(np.asarray(raw, dtype=float)).tolist()) if raw else []
        )
    return out
