from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slimline import StepContext, api
from slimline.candidate import Candidate
from slimline.recipe import recipe_from_dict
from slimline.task import Task, load_task

DIGITS = Path(__file__).parent / "digits_task.py"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Round checkpoints and sensitivity tables go to a per-test step cache (a context from
    ``api.context_for`` without ``cache`` opens ``cache_dir()``); trained fixture weights stay
    shared."""
    import slimline.pipeline.run as pipeline

    root = tmp_path / "prune-cache"
    monkeypatch.setattr(pipeline, "cache_dir", lambda *parts: _mk(root.joinpath(*parts)))


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def digits() -> Task:
    return load_task(str(DIGITS))


def make_context(task: Task, workdir: Path, **recipe: Any) -> StepContext:
    """The pipeline's context on ``task`` with the FP32 torch model as baseline and no
    benchmark (the prune step then skips its PyTorch timing)."""
    rec = recipe_from_dict({"name": "t", "task": task.source, "target": {"threads": 1}, **recipe})
    assert task.model is not None
    fp32 = Candidate("fp32-torch", "fp32", None, module=task.model())
    return api.context_for(task, rec, workdir, baseline=fp32, timed=False)
