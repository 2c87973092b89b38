"""A run's state, which every part of the pipeline reads and adds to: :class:`Run` (the recipe,
the task, the chain of candidates so far, and what the manifest will say), the key a step's
result is cached under (:func:`step_key`), and :class:`stopwatch` (where a run's wall time
went, in the manifest's ``phase_seconds``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cache import StepCache
from ..candidate import Candidate
from ..context import step_key_parts
from ..measure.quality import Quality, Reference
from ..recipe import Recipe, StepConfig
from ..record import json_hash, versions
from ..task import Task

__all__ = ["Run", "has_failed", "step_key", "stopwatch"]

log = logging.getLogger("slimline.pipeline")


@dataclass
class Run:
    recipe: Recipe
    task: Task
    out: Path
    cache: StepCache
    remeasure: bool = False
    hashes: dict[str, str] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=versions)
    chain: list[Candidate] = field(default_factory=list)
    alternatives: list[Candidate] = field(default_factory=list)
    failed: dict[str, Any] | None = None
    reference: Reference | None = None
    warnings: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # profiles, distributions, step records
    started: float = field(default_factory=time.time)
    # the runtimes every candidate is measured on: the target's, or both for runtime auto
    runtimes: list[str] = field(default_factory=lambda: ["onnxruntime"])
    # metric and fidelity of each ONNX file on each runtime, measured once per run: a step's
    # search, its accept/reject verdict and the final figures read the same evaluation
    qualities: dict[tuple[str, str], Quality] = field(default_factory=dict)

    @property
    def serving_runtime(self) -> str:
        """The runtime the selected candidate is served on: the pick's with runtime auto."""
        pick = self.extra.get("runtime_pick") or {}
        return str(pick.get("runtime") or self.runtimes[0])

    @property
    def threads(self) -> int:
        return self.recipe.target.threads

    @property
    def current(self) -> Candidate:
        """The last accepted candidate: the input of the next step."""
        return next(c for c in reversed(self.chain) if c.accepted)

    @property
    def baseline(self) -> Candidate:
        return next(c for c in self.chain if c.name == "fp32-onnx")

    @property
    def selected(self) -> Candidate:
        """The candidate the run serves: the pick's with runtime auto, else the last accepted
        one with an ONNX file."""
        pick = self.extra.get("runtime_pick") or {}
        if pick.get("candidate"):
            return next(c for c in [*self.chain, *self.alternatives] if c.name == pick["candidate"])
        return next(
            (c for c in reversed(self.chain) if c.accepted and c.onnx is not None), self.chain[-1]
        )


def has_failed(c: Candidate) -> bool:
    """A candidate whose step, check, evaluation or timing failed: recorded, never measured."""
    return "failure" in c.meta


def step_key(run: Run, cfg: StepConfig, cand: Candidate) -> str:
    """The step's config, its input's content hash, the task's data, the recipe fields the step
    reads, its own version and its packages' versions (:func:`context.step_key_parts`)."""
    parts = step_key_parts(cfg, cand.content_hash(), run.task, run.hashes, run.recipe)
    return json_hash({**parts, "config": cfg.key_dict()})


class stopwatch:
    """Logs how long ``what`` took; with ``run``, adds it to the manifest's ``phase_seconds``
    (summed over repeats: where a run's wall time went)."""

    def __init__(self, what: str, run: Run | None = None) -> None:
        self.what, self.run = what, run

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        took = time.perf_counter() - self.t0
        log.info("%s: %.1f s", self.what, took)
        if self.run is not None:
            phases = self.run.extra.setdefault("phase_seconds", {})
            phases[self.what] = round(phases.get(self.what, 0.0) + took, 2)
