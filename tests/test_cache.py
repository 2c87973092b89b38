"""Step cache keys name what a step's result depends on and nothing else; concurrent builders of
one entry share it; a second StepCache in the same process leaves live temp dirs alone."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import slimline
from slimline import steps as registry
from slimline.cache import StepCache
from slimline.candidate import Candidate
from slimline.compress.graph import GraphConfig
from slimline.compress.pruning.step import PruneConfig
from slimline.compress.quant.config import QuantizeConfig
from slimline.config import StepConfig
from slimline.pipeline import Run
from slimline.pipeline.run import _baselines
from slimline.pipeline.state import step_key
from slimline.pipeline.step import cached_step
from slimline.recipe import Recipe, recipe_from_dict
from slimline.task import load_task

_GRAPH: type[StepConfig] = GraphConfig  # the registry's key type

KEY_SCRIPT = """
import json, sys
from pathlib import Path
import slimline
from slimline import record
from slimline.cache import StepCache
from slimline.candidate import Candidate
from slimline.pipeline.state import Run, step_key
from slimline.recipe import recipe_from_dict
from slimline.task import load_task

recipe = recipe_from_dict(json.loads(sys.argv[1]))
run = Run(recipe=recipe, task=load_task(recipe.task), out=Path(sys.argv[2]),
          cache=StepCache(Path(sys.argv[2])), hashes={"eval_data": "sha256:e"})
cand = Candidate("fp32-onnx", "export", None, onnx=Path(sys.argv[3]))
print(json.dumps({"package": slimline.__file__, "code_hash": record.code_hash(),
                  "keys": {s.kind: step_key(run, s, cand) for s in recipe.steps}}))
"""


def _keys_from(src: Path, recipe: dict[str, Any], tmp: Path, model: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", KEY_SCRIPT, json.dumps(recipe), str(tmp), str(model)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_editing_an_unrelated_module_keeps_every_step_key(
    tiny_recipe: dict[str, Any], tmp_path: Path
) -> None:
    """A copy of the package whose serve/app.py docstring changed computes the same step keys,
    while the whole-package source hash (what keys were made of before) does change."""
    tiny_recipe["steps"] = ["export", "graph", {"quantize": {"mode": "static"}}]
    original = Path(slimline.__file__).parent
    edited = tmp_path / "edited"
    shutil.copytree(original, edited / "slimline", ignore=shutil.ignore_patterns("__pycache__"))
    app = edited / "slimline" / "serve" / "app.py"
    app.write_text('"""An edited docstring."""\n' + app.read_text())
    model = tmp_path / "model.onnx"
    model.write_bytes(b"not a real model; only its bytes are hashed")
    a = _keys_from(original.parent, tiny_recipe, tmp_path / "a", model)
    b = _keys_from(edited, tiny_recipe, tmp_path / "b", model)
    assert Path(b["package"]).is_relative_to(edited)
    assert a["code_hash"] != b["code_hash"]
    assert a["keys"] == b["keys"] and len(a["keys"]) == 3


@pytest.fixture
def key_run(tiny_recipe: dict[str, Any], tmp_path: Path) -> Run:
    tiny_recipe["steps"] = ["export", "graph", {"quantize": {"mode": "static"}}]
    recipe = recipe_from_dict(tiny_recipe)
    return Run(
        recipe=recipe,
        task=load_task(recipe.task),
        out=tmp_path,
        cache=StepCache(tmp_path / "cache"),
        hashes={"eval_data": "sha256:e"},
    )


def _key(run: Run, cfg: Any, recipe: Recipe | None = None) -> str:
    model = run.out / "m.onnx"
    if not model.exists():
        model.write_bytes(b"m")
    if recipe is not None:
        run = dataclasses.replace(run, recipe=recipe)
    return step_key(run, cfg, Candidate("fp32-onnx", "export", None, onnx=model))


def test_a_key_changes_with_the_steps_version_config_and_packages(
    key_run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = GraphConfig()
    before = _key(key_run, graph)
    assert _key(key_run, GraphConfig(level="basic")) != before
    real_version = metadata.version

    def fake_version(name: str) -> str:
        return "99.0" if name in ("fastapi", "uvicorn") else real_version(name)

    monkeypatch.setattr(metadata, "version", fake_version)  # serving's packages: not graph's
    assert _key(key_run, graph) == before

    def newer_ort(name: str) -> str:
        return "99.0" if name == "onnxruntime" else real_version(name)

    monkeypatch.setattr(metadata, "version", newer_ort)
    assert _key(key_run, graph) != before
    monkeypatch.setattr(metadata, "version", real_version)
    spec = registry.spec_for(GraphConfig)
    monkeypatch.setitem(
        registry._SPECS, _GRAPH, dataclasses.replace(spec, version=spec.version + 1)
    )
    assert _key(key_run, graph) != before


def test_a_key_holds_only_the_recipe_fields_its_step_reads(key_run: Run) -> None:
    r = key_run.recipe
    looser = r.model_copy(update={"budget": r.budget.model_copy(update={"min_cosine": 0.5})})
    threads = r.model_copy(update={"target": r.target.model_copy(update={"threads": 3})})
    graph, quant = GraphConfig(), QuantizeConfig(mode="static")
    assert _key(key_run, graph, looser) == _key(key_run, graph)  # graph does not read the budget
    assert _key(key_run, quant, looser) != _key(key_run, quant)  # quantize does
    assert _key(key_run, graph, threads) != _key(key_run, graph)


def test_fields_that_do_not_change_a_result_stay_out_of_the_key(key_run: Run) -> None:
    quiet = PruneConfig(progress=False, workers=4, finetune={"progress": False})
    assert quiet.key_dict() == PruneConfig().key_dict()
    assert PruneConfig(target=0.5).key_dict() != PruneConfig().key_dict()
    assert _key(key_run, quiet) == _key(key_run, PruneConfig())


def test_a_changed_step_version_reruns_only_that_step(
    tiny_recipe: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    recipe = recipe_from_dict(tiny_recipe)
    graph = recipe.steps[1]

    def run_graph(out: str) -> None:
        run = Run(recipe=recipe, task=load_task(recipe.task), out=tmp_path / out, cache=cache)
        _baselines(run)
        cached_step(run, graph, run.current)

    cache = StepCache(tmp_path / "cache")
    run_graph("a")
    caplog.set_level("INFO", logger="slimline")
    run_graph("b")
    assert "step export: reusing" in caplog.text and "step graph: reusing" in caplog.text
    caplog.clear()
    spec = registry.spec_for(GraphConfig)
    monkeypatch.setitem(
        registry._SPECS, _GRAPH, dataclasses.replace(spec, version=spec.version + 1)
    )
    run_graph("c")
    assert "step export: reusing" in caplog.text and "step graph: running" in caplog.text


def test_the_second_of_two_builders_reuses_the_first_ones_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs build one entry at once. The other run publishes just before this one renames
    its temp dir into place, so the rename fails (ENOTEMPTY): this run returns the other's
    entry instead of failing."""
    first, second = StepCache(tmp_path), StepCache(tmp_path)
    real_rename = os.rename
    raced: list[bool] = []

    def rename_after_the_other_run(src: Any, dst: Any) -> None:
        if not raced:
            raced.append(True)
            first.build_step("sha256:same", build_first)  # the other run wins the race
        real_rename(src, dst)

    def build_first(d: Path) -> dict[str, Any]:
        (d / "m.onnx").write_bytes(b"first")
        return {"by": "first"}

    def build_second(d: Path) -> dict[str, Any]:
        (d / "m.onnx").write_bytes(b"second")
        return {"by": "second"}

    monkeypatch.setattr(os, "rename", rename_after_the_other_run)
    entry = second.build_step("sha256:same", build_second)
    assert raced and entry == first.step_dir("sha256:same")
    assert (entry / "m.onnx").read_bytes() == b"first"
    assert json.loads((entry / "result.json").read_text()) == {"by": "first"}
    assert [p.name for p in (tmp_path / "steps").iterdir()] == [entry.name]


def test_a_second_cache_in_the_same_process_keeps_a_live_temp_dir(tmp_path: Path) -> None:
    cache = StepCache(tmp_path)
    seen: list[Path] = []

    def build(d: Path) -> dict[str, Any]:
        (d / "m.onnx").write_bytes(b"x")
        StepCache(tmp_path)  # e.g. a step that opens the cache again, or a second run
        seen.append(d)
        assert (d / "m.onnx").is_file(), "the second StepCache deleted a live temp dir"
        return {}

    entry = cache.build_step("sha256:k", build)
    assert (entry / "m.onnx").read_bytes() == b"x" and not seen[0].exists()


def test_a_temp_dir_left_by_an_earlier_process_with_this_pid_is_removed(tmp_path: Path) -> None:
    StepCache(tmp_path)
    left = tmp_path / "steps" / f"tmp-{os.getpid()}-0000dead"
    left.mkdir()
    StepCache(tmp_path)
    assert not left.exists()


def test_a_relative_cache_folder_is_held_as_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps hand cache paths to child processes and runtimes: a relative ``--cache`` once
    made the quantize step look for its prepared model under the wrong folder."""
    monkeypatch.chdir(tmp_path)
    cache = StepCache(Path("c"))
    assert cache.root == tmp_path / "c" and (tmp_path / "c" / "steps").is_dir()
