"""One step of a run (:func:`run_step`), on the last accepted candidate.

The step's handler (found in the step registry, :mod:`slimline.steps`) runs in a fresh work
directory that becomes its cache entry, under a key that hashes its inputs (:func:`cached_step`);
a rerun or a resumed run reuses the entry. The candidate it returns is checked (``onnx.checker``
plus an ONNX Runtime load) and judged against its parent (:func:`.judge.decide`), and so is each
rival the step built (NNCF's INT8 model). A step that fails, or whose output fails its check,
is recorded as rejected with the error as its reason and the next step starts from the parent;
only an error in the user's input (:func:`~slimline.errors.is_user_error`) stops the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..candidate import Candidate
from ..errors import StepError, error_text, is_user_error
from ..measure.runners import check_candidate
from ..recipe import StepConfig
from ..steps import handler_for, restorer_for
from .judge import decide
from .measurement import compare, step_context
from .state import Run, log, step_key, stopwatch

__all__ = ["cached_step", "run_step"]


def run_step(run: Run, cfg: StepConfig) -> None:
    """Run step ``cfg`` on the last accepted candidate (or reuse its cached result), judge what
    it returned and its rivals, and append the step's candidate to the chain, kept or not."""
    parent = run.current
    n_alt = len(run.alternatives)
    try:
        cand = cached_step(run, cfg, parent)
    except Exception as err:
        if is_user_error(err):
            raise
        _reject_failed_step(run, cfg, parent, err)
        return
    cand.name, cand.parent = _unique_name(run, cand.name), parent.name
    for alt in run.alternatives[n_alt:]:
        alt.name = _unique_name(run, alt.name) if alt.name == cand.name else alt.name
    try:
        if cand.onnx is not None and "onnxruntime" in run.runtimes:
            check_candidate(cand.onnx, run.threads)
        cand.accepted, cand.reason = decide(run, cfg, parent, cand)
    except Exception as err:
        if is_user_error(err):
            raise
        cand.accepted, cand.reason = False, f"failed: {error_text(err)}"
        cand.meta = {**cand.meta, "failure": _failure_record(err)}
    log.info("step %s: %s (%s)", cfg.kind, "ACCEPTED" if cand.accepted else "REJECTED", cand.reason)
    rivals = [a for a in run.alternatives[n_alt:] if a.meta.get("competes")]
    run.chain.append(_compete(run, cfg, parent, cand, rivals))


def cached_step(run: Run, cfg: StepConfig, cand: Candidate) -> Candidate:
    """The candidate step ``cfg`` makes from ``cand``: from its cache entry, or built into a
    new one (:meth:`~slimline.cache.StepCache.build_step` runs :func:`_execute` in it)."""
    key = step_key(run, cfg, cand)
    entry = run.cache.step_dir(key)
    if entry is None:
        log.info("step %s: running", cfg.kind)
        with stopwatch(f"step {cfg.kind}", run):
            entry = run.cache.build_step(key, lambda tmp: _execute(run, cfg, cand, tmp))
    else:
        log.info("step %s: reusing cached result %s", cfg.kind, entry.name)
    return _load_entry(run, cfg, cand, entry)


def _execute(run: Run, cfg: StepConfig, cand: Candidate, workdir: Path) -> dict[str, Any]:
    ctx = step_context(run, workdir).for_candidate(cand)
    try:
        out = handler_for(cfg)(cfg, cand, ctx)
        ctx.keep_frozen([out, *ctx.alternatives])
    except Exception as err:
        if is_user_error(err):
            raise
        details = err.details if isinstance(err, StepError) else {}
        kind = type(err) if isinstance(err, StepError) else StepError  # ExportError stays one
        raise kind(
            f"step {cfg.kind} failed on {cand.name}: {error_text(err)}",
            details={**details, "warnings": ctx.warnings},
        ) from err
    return {
        "chosen": _cand_record(out, workdir),
        "warnings": ctx.warnings,
        "alternatives": [_cand_record(c, workdir) for c in ctx.alternatives],
    }


def _cand_record(c: Candidate, workdir: Path) -> dict[str, Any]:
    rel = None
    if c.onnx is not None:
        path = Path(c.onnx).resolve()
        if workdir.resolve() not in path.parents:
            raise StepError(f"step {c.step} returned {path}, outside its work directory")
        rel = str(path.relative_to(workdir.resolve()))
    return {
        "name": c.name,
        "step": c.step,
        "parent": c.parent,
        "onnx": rel,
        "meta": c.meta,
        "accepted": c.accepted,
        "reason": c.reason,
        "measurement": c.measurement,
    }


def _from_record(rec: dict[str, Any], entry: Path) -> Candidate:
    return Candidate(
        name=rec["name"],
        step=rec["step"],
        parent=rec["parent"],
        onnx=entry / rec["onnx"] if rec["onnx"] else None,
        meta=rec["meta"],
        accepted=rec["accepted"],
        reason=rec["reason"],
        measurement=rec["measurement"],
    )


def _load_entry(run: Run, cfg: StepConfig, parent: Candidate, entry: Path) -> Candidate:
    import json

    result = json.loads((entry / "result.json").read_text())
    chosen = _from_record(result["chosen"], entry)
    restore = restorer_for(cfg)
    chosen.module = restore(entry, chosen.meta, run.task) if restore else parent.module
    for w in result.get("warnings", []):
        if w not in run.warnings:
            run.warnings.append(w)
    for rec in result.get("alternatives", []):
        run.alternatives.append(_from_record(rec, entry))
    return chosen


def _unique_name(run: Run, name: str) -> str:
    taken = {c.name for c in [*run.chain, *run.alternatives]}
    if name not in taken:
        return name
    i = 2
    while f"{name}-{i}" in taken:
        i += 1
    return f"{name}-{i}"


def _compete(
    run: Run, cfg: StepConfig, parent: Candidate, cand: Candidate, rivals: list[Candidate]
) -> Candidate:
    """Judge each rival the step built (an alternative marked ``competes``: NNCF's INT8 model)
    against the same parent, on the same budget, like the chosen candidate. With one runtime
    an accepted rival that is faster than the chosen one in a direct interleaved comparison
    takes its place in the chain; with runtime auto every accepted rival is measured on both
    runtimes and can be the pick. Returns the step's candidate for the chain."""
    for rival in rivals:
        try:
            if rival.onnx is not None and "onnxruntime" in run.runtimes:
                check_candidate(rival.onnx, run.threads)
            rival.accepted, rival.reason = decide(run, cfg, parent, rival)
        except Exception as err:
            if is_user_error(err):
                raise
            rival.accepted, rival.reason = False, f"failed: {error_text(err)}"
        log.info("step %s rival %s: %s (%s)", cfg.kind, rival.name, rival.accepted, rival.reason)
        if len(run.runtimes) == 1 and rival.accepted and _beats(run, rival, cand):
            run.alternatives[run.alternatives.index(rival)] = cand
            cand.meta = {**cand.meta, "replaced_by": rival.name}
            cand = rival
    return cand


def _beats(run: Run, rival: Candidate, cand: Candidate) -> bool:
    """``rival`` is faster than ``cand`` (or ``cand`` was rejected), measured interleaved."""
    if not cand.accepted:
        return True
    lat = compare(run, [cand, rival])
    return bool(lat[rival.name]["latency_ms"]["p50"] < lat[cand.name]["latency_ms"]["p50"])


def _reject_failed_step(run: Run, cfg: StepConfig, parent: Candidate, err: Exception) -> None:
    """A step that failed as a whole: a rejected entry with the error as its reason (nothing to
    run or measure); the next step starts from ``parent``."""
    reason = f"failed: {error_text(err)}"
    failure = _failure_record(err)
    for w in failure.pop("warnings", []):
        if w not in run.warnings:
            run.warnings.append(w)
    cand = Candidate(
        name=_unique_name(run, cfg.kind),
        step=cfg.kind,
        parent=parent.name,
        accepted=False,
        reason=reason,
        meta={"failure": failure},
    )
    run.chain.append(cand)
    msg = f"step {cfg.kind} rejected: {reason}; the run goes on from {parent.name}"
    run.warnings.append(msg)
    log.warning(msg)


def _failure_record(err: Exception) -> dict[str, Any]:
    details = err.details if isinstance(err, StepError) else {}
    return {"type": type(err).__name__, "error": error_text(err), **details}
