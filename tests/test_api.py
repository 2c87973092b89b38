"""slimline.api: a step context for a task, built the way the pipeline builds it, and export,
quantize and evaluate through the registered steps."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import onnx
import pytest

from slimline import StepContext, api, load_task
from slimline.candidate import Candidate
from slimline.compress.quant.config import QuantizeConfig
from slimline.measure.quality import Quality
from slimline.recipe import recipe_from_dict
from slimline.task import Task


@pytest.fixture
def tiny(tiny_task_file: Path) -> Task:
    return load_task(str(tiny_task_file))


def _recipe(tiny_recipe: dict[str, Any], **changes: Any) -> Any:
    return recipe_from_dict({**tiny_recipe, **changes})


def _ops(path: Path | None) -> set[str]:
    assert path is not None
    return {n.op_type for n in onnx.load(str(path)).graph.node}


def test_context_for_a_task_exports_its_baseline_with_the_recipes_settings(
    tiny: Task, tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    recipe = _recipe(tiny_recipe, steps=[{"export": {"opset": 18}}])
    ctx = api.context_for(tiny, recipe, tmp_path / "work", cache=cache)
    assert isinstance(ctx, StepContext) and ctx.workdir == tmp_path / "work"
    base = ctx.baseline
    assert base.name == "fp32-onnx" and base.onnx is not None and base.onnx.is_file()
    assert base.meta["opset"] == 18  # the recipe's export settings, not a fixed opset
    assert base.meta["export_check"]["cosine_min"] > 0.9999
    # the tiny task's labels are its model's own answers: the FP32 reference scores 1.0
    assert ctx.reference.metric == 1.0
    quality = api.evaluate(ctx, base)
    assert quality.metric == 1.0 and quality.cosine_min > 0.9999
    assert ctx.compare_fn is not None


def test_quantize_runs_the_registered_step_and_evaluates(
    tiny: Task, tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    ctx = api.context_for(tiny, _recipe(tiny_recipe), tmp_path / "work", cache=cache)
    cfg = QuantizeConfig(mode="dynamic", samples=32, keep_first_last_float=False)
    int8 = api.quantize(ctx, ctx.baseline, cfg)
    assert int8.step == "quantize" and int8.onnx is not None
    assert ctx.workdir / "quantize" in int8.onnx.parents  # its own directory under the context's
    assert _ops(int8.onnx) & {"ConvInteger", "MatMulInteger", "DynamicQuantizeLinear"}
    assert int8.meta["calibration"]["samples"] == 32
    quality = api.evaluate(ctx, int8)
    assert quality.cosine_mean > 0.95 and 0.0 <= quality.metric <= 1.0
    assert quality.cosine_mean < 1.0  # INT8 moved the outputs: it measured the quantized model


def test_injected_evaluate_and_compare_are_the_ones_steps_call(
    tiny: Task, tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    default = api.context_for(tiny, _recipe(tiny_recipe), tmp_path / "a", cache=cache)
    assert default.evaluate_fn is not None and default.compare_fn is not None
    evaluated: list[str] = []
    compared: list[list[str]] = []

    def evaluate(c: Candidate) -> Quality:
        evaluated.append(c.name)
        assert default.evaluate_fn is not None
        return default.evaluate_fn(c)

    def compare(cs: list[Candidate]) -> dict[str, dict[str, Any]]:
        compared.append([c.name for c in cs])
        assert default.compare_fn is not None
        return default.compare_fn(cs)

    ctx = api.context_for(
        tiny, _recipe(tiny_recipe), tmp_path / "b", evaluate=evaluate, compare=compare, cache=cache
    )
    out = api.quantize(ctx, ctx.baseline, QuantizeConfig(mode="auto", samples=32))
    tried = {out.name, *(a.name for a in ctx.alternatives)}
    # every variant's quality came from the injected `evaluate`
    assert evaluated and set(evaluated) >= tried - {"quantize"}
    assert compared and all(names[0] == "fp32-onnx" for names in compared)
    assert out.measurement is not None and "fidelity" in out.measurement


def test_a_context_without_a_benchmark(
    tiny: Task, tiny_recipe: dict[str, Any], tmp_path: Path, cache: Path
) -> None:
    module = tiny.model()  # type: ignore[misc]
    torch_fp32 = Candidate("fp32-torch", "fp32", None, module=module)
    ctx = api.context_for(
        tiny, _recipe(tiny_recipe), tmp_path, baseline=torch_fp32, timed=False, cache=cache
    )
    assert ctx.baseline.module is module and ctx.compare_fn is None
    assert ctx.baseline.accepted and not torch_fp32.accepted  # the caller's candidate untouched
    with pytest.raises(AssertionError, match="without compare_fn"):
        ctx.compare([torch_fp32])
    exported = api.export(ctx, module)
    assert exported.onnx is not None and exported.onnx.parent == tmp_path / "export"
    assert exported.meta["export_check"]["cosine_min"] > 0.9999
    assert api.evaluate(ctx, exported).metric == 1.0


def private_imports(source: str) -> list[str]:
    """Each import of a private slimline name or module (``_x``) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slimline"):
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("slimline")]
        else:
            continue
        found += [n for n in names if any(part.startswith("_") for part in n.split("."))]
    return found


def test_bench_scripts_use_public_names_only() -> None:
    bench = Path(__file__).parent.parent / "bench"
    scripts = sorted(bench.rglob("*.py"))
    assert len(scripts) > 20, "bench/ was not found"
    assert {str(p.relative_to(bench)): private_imports(p.read_text()) for p in scripts} == {
        str(p.relative_to(bench)): [] for p in scripts
    }
    assert private_imports("from slimline.a import _b, c\nimport slimline._d.e\n") == [
        "slimline.a._b",
        "slimline._d.e",
    ]
