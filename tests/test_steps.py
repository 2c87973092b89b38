"""Step contracts: an impossible order is a one-line recipe error before any work; a step module
under a scanned package registers itself without being listed anywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slimline.compress.pruning.step import PruneConfig
from slimline.discover import import_all
from slimline.errors import RecipeError
from slimline.recipe import recipe_from_dict
from slimline.report import sections
from slimline.steps import check_order, config_class, registered_kinds, spec_for, start_forms


def _recipe(steps: list[Any], task: str = "task.py") -> dict[str, Any]:
    return {"name": "r", "task": task, "steps": steps}


@pytest.mark.parametrize(
    ("steps", "task", "message"),
    [
        (
            ["export", "quantize", "prune"],
            "task.py",
            "steps[2] prune needs a torch model, but after steps[1] quantize the candidate holds "
            "a quantized ONNX graph; put prune before quantize",
        ),
        (
            ["quantize", "quantize"],
            "task.py",
            "steps[1] quantize needs a float ONNX graph, but after steps[0] quantize the "
            "candidate holds a quantized ONNX graph; remove the repeat",
        ),
        (["export", "export"], "task.py", "steps[1] export: a recipe runs export once"),
        (
            ["graph", "prune"],
            "model.onnx",
            "steps[1] prune needs a torch model, but the task gives a float ONNX graph; "
            "remove prune",
        ),
        (["export"], "model.onnx", "steps[0] export needs a torch model, but the task gives"),
    ],
)
def test_an_impossible_order_is_a_one_line_recipe_error(
    steps: list[Any], task: str, message: str
) -> None:
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(_recipe(steps, task))
    text = str(err.value)
    assert message in text and "\n" not in text


@pytest.mark.parametrize(
    "steps",
    [
        ["export", {"prune": {}}, "graph", "quantize"],
        ["export", "graph", "prune", "quantize"],  # the graph step keeps the torch model
        ["quantize", "graph"],  # a quantized graph may still be optimized
        ["prune", "export"],  # export makes the baseline wherever it is listed
    ],
)
def test_possible_orders_pass(steps: list[Any]) -> None:
    assert [s.kind for s in recipe_from_dict(_recipe(steps)).steps] == [
        s if isinstance(s, str) else next(iter(s)) for s in steps
    ]


def test_a_step_that_a_rejected_predecessor_would_leave_stranded_is_an_error() -> None:
    """Any step may be rejected at run time, so its successor must accept both outcomes."""
    prune, quant = PruneConfig(), config_class("quantize")()
    assert check_order([quant, prune], start_forms(onnx_task=False)) is not None
    assert check_order([prune, quant], start_forms(onnx_task=False)) is None


def test_the_run_checks_the_loaded_tasks_kind() -> None:
    """The recipe checks the task's file name; the run checks what it loaded (before any work)."""
    assert check_order([PruneConfig()], start_forms(onnx_task=True)) == (
        "steps[0] prune needs a torch model, but the task gives a float ONNX graph; remove prune"
    )


def test_every_builtin_step_declares_what_its_key_depends_on() -> None:
    assert registered_kinds() == ["export", "graph", "nncf", "prune", "qat", "quantize"]
    for kind in registered_kinds():
        spec = spec_for(config_class(kind))
        assert spec.contract.consumes and spec.version >= 1 and spec.packages
    assert "steps.export" in spec_for(PruneConfig).reads  # prune exports with the recipe's export


STEP_MODULE = """
from typing import Any, ClassVar

from slimline.candidate import Candidate
from slimline.config import StepConfig
from slimline.steps import Contract, step


class QatConfig(StepConfig):
    kind: ClassVar[str] = "qat-test"
    steps: int = 10


@step(QatConfig, contract=Contract(consumes=("torch",), produces=("onnx-int8",)), packages=("torch",))
def qat(cfg: QatConfig, cand: Candidate, ctx: object) -> Candidate:
    return cand
"""


def test_a_new_step_module_under_a_scanned_package_registers_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "extra_steps"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "qat.py").write_text(STEP_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import_all(["extra_steps"])
    recipe = recipe_from_dict(_recipe(["export", {"qat-test": {"steps": 3}}]))
    assert recipe.steps[1].kind == "qat-test"
    with pytest.raises(RecipeError, match="steps\\[2\\] prune needs a torch model"):
        recipe_from_dict(_recipe(["export", "qat-test", "prune"]))


def test_report_sections_register_themselves_from_their_packages() -> None:
    titles = {title for _, title, _ in sections()}
    assert {"Run", "Candidates", "Structured pruning"} <= titles
