"""``slimline publish RUN_DIR --repository DIR --model NAME``: a run as a model's next version.

The new version folder (``DIR/NAME/<latest + 1>/``) holds the run's ``manifest.json``, its
selected artifact (with an external-data file beside it, if any) and its
``monitor_reference.npz`` when present: what ``slimline serve --repository`` loads. Unless
``--no-gate``, the run must first pass ``slimline check`` against the latest version's
manifest; a failing gate prints its regressions, publishes nothing and exits 1. The folder is
written under a temporary name and renamed, so a server scanning the repository never sees half
a version.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from ..candidate import artifact_files
from ..errors import ServeError
from .model import resolve_model_path
from .monitor import REFERENCE_FILE
from .repository import version_dirs

__all__ = ["publish", "register_publish"]

log = logging.getLogger(__name__)


def register_publish(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "publish",
        help="add a run to a model repository as the model's next version (gated)",
        description="Copy a run's manifest and selected artifact into DIR/NAME/<next version>/; "
        "exit 1 when `slimline check` against the latest version fails.",
    )
    p.add_argument("run_dir", type=Path, help="run directory written by `slimline optimize`")
    p.add_argument("--repository", type=Path, required=True, metavar="DIR")
    p.add_argument("--model", required=True, help="model name in the repository")
    p.add_argument("--no-gate", action="store_true", help="publish without the check")
    p.add_argument("--no-reference", action="store_true",
                   help="do not save the evaluation outputs the drift monitor compares with")  # fmt: skip
    p.add_argument("--max-latency-regression", type=float, default=0.10)
    p.add_argument("--max-metric-drop", type=float, default=0.005)
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    version, regressions = publish(
        args.run_dir,
        args.repository,
        args.model,
        gate=not args.no_gate,
        max_latency_regression=args.max_latency_regression,
        max_metric_drop=args.max_metric_drop,
        reference=not args.no_reference,
    )
    if version is None:
        for line in regressions:
            print(line)
        print(f"publish REFUSED: {len(regressions)} regression(s) against the latest version")
        return 1
    print(f"published {args.run_dir} as {args.model} version {version} in {args.repository}")
    return 0


def publish(
    run_dir: Path,
    repository: Path,
    model: str,
    *,
    gate: bool = True,
    max_latency_regression: float = 0.10,
    max_metric_drop: float = 0.005,
    reference: bool = True,
) -> tuple[int | None, list[str]]:
    """``(new version, [])``, or ``(None, regression lines)`` when the gate refused the run.
    ``reference``: first save the run's evaluation outputs for the drift monitor (when the run
    has none and its task loads here)."""
    if not model or "/" in model or model.startswith("."):
        raise ServeError(f"model name {model!r} must be a plain folder name")
    _, artifact, _ = resolve_model_path(run_dir)  # a run directory with its artifact, or raise
    model_dir = repository / model
    versions = version_dirs(model_dir)
    latest = versions[max(versions)] if versions else None
    if gate and latest is not None and (latest / "manifest.json").is_file():
        regressions = _check(run_dir, latest, max_latency_regression, max_metric_drop)
        if regressions:
            return None, regressions
    version = max(versions, default=0) + 1
    if reference and not (run_dir / REFERENCE_FILE).is_file():
        _write_reference(run_dir)
    _copy_version(run_dir, artifact, model_dir, version)
    return version, []


def _write_reference(run_dir: Path) -> None:
    """The drift monitor's reference; a run whose task cannot be loaded here is published
    without one (its server then exports no drift score), with a warning that says so."""
    from ..errors import SlimlineError
    from .reference import write_monitor_reference

    try:
        write_monitor_reference(run_dir)
    except (SlimlineError, OSError, ImportError, ValueError, KeyError) as err:
        log.warning("no drift reference for %s (its task's evaluation data: %s); the server "
                    "will export no drift score for this version", run_dir, err)  # fmt: skip


def _check(run_dir: Path, latest: Path, max_latency: float, max_drop: float) -> list[str]:
    from ..gate import compare_manifests

    current = json.loads((run_dir / "manifest.json").read_text())
    baseline = json.loads((latest / "manifest.json").read_text())
    regressions, _ = compare_manifests(
        current, baseline, max_latency_regression=max_latency, max_metric_drop=max_drop
    )
    return [str(r) for r in regressions]


def _copy_version(run_dir: Path, artifact: Path, model_dir: Path, version: int) -> None:
    final = model_dir / str(version)
    staging = model_dir / f".{version}.partial"
    if staging.exists():
        shutil.rmtree(staging)
    relative = artifact.relative_to(run_dir)
    (staging / relative.parent).mkdir(parents=True)
    shutil.copy2(run_dir / "manifest.json", staging / "manifest.json")
    for path in {*artifact.parent.glob(artifact.name + "*"), *artifact_files(artifact)}:
        shutil.copy2(path, staging / relative.parent / path.name)  # + .onnx.data, or an IR's .bin
    if (run_dir / REFERENCE_FILE).is_file():
        shutil.copy2(run_dir / REFERENCE_FILE, staging / REFERENCE_FILE)
    try:
        staging.rename(final)
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise ServeError(
            f"cannot publish to {final} ({err}); another publish raced this one"
        ) from None
