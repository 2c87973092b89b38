from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slimline.candidate import Candidate
from slimline.context import StepContext
from slimline.measure.quality import evaluate, make_reference
from slimline.measure.runners import TorchRunner, make_runner
from slimline.recipe import recipe_from_dict
from slimline.task import Task, load_task

DIGITS = Path(__file__).parent / "digits_task.py"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Round checkpoints and sensitivity tables go to a per-test step cache (a context built
    without one opens ``cache_dir()``); trained fixture weights stay shared."""
    import slimline.context as context

    root = tmp_path / "prune-cache"
    monkeypatch.setattr(context, "cache_dir", lambda *parts: _mk(root.joinpath(*parts)))


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def digits() -> Task:
    return load_task(str(DIGITS))


def make_context(task: Task, workdir: Path, **recipe: Any) -> StepContext:
    rec = recipe_from_dict({"name": "t", "task": task.source, "target": {"threads": 1}, **recipe})
    assert task.model is not None
    ref = make_reference(TorchRunner("fp32", task.model(), 1), task, None)
    fp32 = Candidate("fp32-torch", "fp32", None, module=task.model())
    return StepContext(
        task=task,
        recipe=rec,
        workdir=workdir,
        baseline=fp32,
        reference=ref,
        _evaluate=lambda c: evaluate(make_runner(c, 1), task, ref, None),
    )
