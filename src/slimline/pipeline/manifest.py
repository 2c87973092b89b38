"""``manifest.json``: what a run did and measured (:func:`write_manifest`), written atomically
after the baselines, after each step and at the end, with each candidate's ONNX file copied
under ``artifacts/``.
"""

from __future__ import annotations

import time
from typing import Any

from ..candidate import Candidate, artifact_files, artifact_hash, is_ir
from ..envlock import environment_record
from ..record import MANIFEST_SCHEMA, atomic_copy, atomic_write_json, hardware, now_iso
from ..runtimes import runtime_record
from ..steps import spec_for
from .state import Run, has_failed

__all__ = ["write_manifest"]


def write_manifest(run: Run, status: str) -> None:
    """``run.out/manifest.json`` with ``status`` (running, complete or failed), atomically."""
    task = run.task
    chain = [_entry(run, c) for c in run.chain]
    alts = [{**_entry(run, c), "alternative": True} for c in run.alternatives]
    manifest: dict[str, Any] = {
        "schema": MANIFEST_SCHEMA,
        "status": status,
        "recipe": run.recipe.to_dict(),
        "created": now_iso(),
        "wall_seconds": round(time.time() - run.started, 1),
        "task": {
            "name": task.name,
            "source": task.source,
            "metric_name": task.metric_name,
            "output_kind": task.output_kind,
            "inputs": _input_spec(run),
            "signature": task.signature.to_dict() if task.signature else None,
            # inputs with one value in deployment: a candidate the graph step froze them into
            # no longer takes them (its artifact records them in its metadata too)
            "constant_inputs": {k: v.tolist() for k, v in task.constant_inputs.items()},
            "notes": task.notes,
        },
        "hashes": run.hashes,
        "versions": run.versions,
        "step_versions": {s.kind: spec_for(s).version for s in run.recipe.steps},
        "hardware": hardware(),
        "environment": environment_record(),  # the installed versions against the lock
        "target": run.recipe.target.model_dump(),
        "runtimes": {rt: runtime_record(rt, run.threads) for rt in run.runtimes},
        "selected_runtime": run.serving_runtime if run.chain else None,
        "selected": run.selected.name if run.chain else None,
        "reference_metric": run.reference.metric if run.reference else None,
        "candidates": chain + alts,
        "warnings": run.warnings,
        **run.extra,
    }
    if run.failed:
        manifest["failure"] = run.failed
    atomic_write_json(run.out / "manifest.json", manifest)


def _entry(run: Run, c: Candidate) -> dict[str, Any]:
    artifact = None
    if c.onnx is not None:
        artifact = f"artifacts/{c.name}{'.xml' if is_ir(c.onnx) else '.onnx'}"
        dst = run.out / artifact
        if not dst.exists() or artifact_hash(dst) != c.content_hash():
            for src, to in zip(artifact_files(c.onnx), artifact_files(dst), strict=True):
                atomic_copy(src, to)
    m = c.measurement or {}
    return {
        "name": c.name,
        "step": c.step,
        "parent": c.parent,
        "accepted": bool(c.accepted),
        "reason": c.reason,
        "artifact": artifact,
        "runtime": None if has_failed(c) and c.onnx is None else _served_on(run, c),
        **m,
        "meta": c.meta,
    }


def _served_on(run: Run, c: Candidate) -> str:
    """The runtime a candidate's top-level figures were measured on."""
    return run.serving_runtime if c.onnx is not None else c.runtime


def _input_spec(run: Run) -> dict[str, Any]:
    path = next((c.onnx for c in run.chain if c.onnx is not None), None)
    if path is None:
        return {}
    from ..measure.runners import ort_session, session_input_spec

    spec = session_input_spec(ort_session(path, 1, level="disable"))
    return {k: {"dtype": d, "shape": s} for k, (d, s) in spec.items()}
