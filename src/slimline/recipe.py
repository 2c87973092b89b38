"""Typed recipe: what to optimize, for which target, within which budget, by which steps.

A recipe is a YAML file (or the same object built in Python). Every config rejects unknown keys and
validates on construction and on assignment. Steps are written as one-key mappings::

    steps:
      - export: {opset: 17}
      - graph: {level: extended}

and are mapped onto the config class registered for that key (see :mod:`slimline.steps`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from .config import Config, StepConfig
from .errors import RecipeError
from .outputs import HOOK_PATTERN, BoxesOutput, OutputDecl
from .steps import check_order, config_class, start_forms

__all__ = [
    "BenchConfig",
    "BudgetConfig",
    "Config",
    "InputConfig",
    "Recipe",
    "StepConfig",
    "TargetConfig",
    "load_recipe",
    "recipe_from_dict",
]

RECIPE_VERSION: Literal[1] = 1

# a constant input's value: a number, a bool, or a (nested) list of them
ConstantValue = int | float | bool | list[Any]


S = TypeVar("S", bound=StepConfig)


class TargetConfig(Config):
    # auto: every candidate measured on both, the fastest (runtime, candidate) pair within
    # budget served (see slimline.runtimes); openvino and auto need `slimline[openvino]`
    runtime: Literal["onnxruntime", "openvino", "auto"] = "onnxruntime"
    provider: Literal["CPUExecutionProvider"] = "CPUExecutionProvider"
    threads: int = Field(default_factory=lambda: max(1, os.cpu_count() or 1), ge=1, le=256)
    memory_mb: float | None = Field(
        None, gt=0.0, description="peak RSS budget: the runtime setting is chosen to fit it"
    )

    # the budget picks the serving setting after the run; it changes no step's result
    not_in_key: ClassVar[frozenset[str]] = frozenset({"memory_mb"})


class BudgetConfig(Config):
    """What a step may cost in quality, and what it must win to be kept."""

    max_metric_drop: float = Field(0.01, ge=0.0, description="absolute drop of the task metric")
    min_cosine: float = Field(
        0.99, ge=-1.0, le=1.0, description="min mean cosine to FP32 of the undeclared outputs"
    )
    min_agreement: float = Field(
        0.99, ge=0.0, le=1.0, description="min agreement of the outputs declared by kind"
    )
    p99_ms: float | None = Field(None, gt=0.0, description="optional p99 latency target at batch 1")
    objective: Literal["latency", "size"] = "latency"
    min_gain: float = Field(
        0.03, ge=0.0, lt=1.0, description="a step must be at least this much faster (or smaller)"
    )


class BenchConfig(Config):
    """How candidates are measured. Rounds interleave candidates (A B C A B C ...)."""

    rounds: int = Field(5, ge=1, le=100)
    runs_per_round: int = Field(60, ge=1)
    warmup: int = Field(10, ge=0)
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 8, 32])
    throughput_min_seconds: float = Field(0.15, gt=0.0, description="per batch size per round")
    throughput_rounds: int = Field(
        3,
        ge=1,
        description="rounds in which throughput is measured, spread evenly over the benchmark "
        "(every round when rounds is not larger); latency is timed in every round",
    )
    peak_rss: bool = True
    eval_limit: int | None = Field(None, ge=1, description="cap on evaluation samples")

    @field_validator("batch_sizes")
    @classmethod
    def _positive_batches(cls, v: list[int]) -> list[int]:
        if not v or any(b < 1 for b in v):
            raise ValueError("batch_sizes must be a non-empty list of positive integers")
        return sorted(set(v))

    @model_validator(mode="after")
    def _enough_runs(self) -> BenchConfig:
        if self.rounds * self.runs_per_round < 200:
            raise ValueError(
                f"rounds x runs_per_round = {self.rounds * self.runs_per_round}; latency needs "
                "at least 200 runs: raise runs_per_round"
            )
        return self


class InputConfig(Config):
    """How an ONNX task's input is batched, where slimline cannot infer it from the model."""

    batch_axis: int | None = Field(
        ..., ge=0, description="the axis holding the rows; null: none, passed whole to every call"
    )


class Recipe(Config):
    version: Literal[1] = RECIPE_VERSION
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    task: str = Field(..., description="example name, task .py file, or model .onnx file")
    samples: str | None = Field(None, description=".npz of sample inputs, for an ONNX task")
    eval_samples: str | None = Field(
        None, description=".npz of evaluation inputs (ONNX task); default: rows held out of samples"
    )
    inputs: dict[str, InputConfig] = Field(
        default_factory=dict, description="ONNX task: batch axis per input name, where ambiguous"
    )
    primary_output: str | None = Field(
        None, description="ONNX task: the output the metric reads; default: the first"
    )
    metric: str | None = Field(
        None,
        pattern=HOOK_PATTERN,
        description="ONNX task: metric hook file.py:function(outputs, labels), labels in "
        "eval_samples (an array named 'labels'); default: mean cosine to FP32",
    )
    outputs: dict[str, OutputDecl] = Field(
        default_factory=dict,
        description="output name -> its kind (logits, probability_map, ctc, boxes); "
        "undeclared outputs are judged by cosine",
    )
    constant_inputs: dict[str, ConstantValue] = Field(
        default_factory=dict,
        description="ONNX task: input name -> the one value it takes in deployment (e.g. a "
        "sample rate); the graph step freezes it into the model and folds what it decides",
    )
    target: TargetConfig = Field(default_factory=TargetConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)
    steps: list[StepConfig] = Field(default_factory=list)

    @field_validator("steps", mode="before")
    @classmethod
    def _build_steps(cls, raw: Any) -> list[StepConfig]:
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise ValueError("steps must be a list, e.g. [export, {graph: {level: extended}}]")
        steps: list[StepConfig] = []
        for i, item in enumerate(raw):
            if isinstance(item, StepConfig):
                steps.append(item)
                continue
            if isinstance(item, str):
                item = {item: {}}
            if not isinstance(item, dict) or len(item) != 1:
                raise ValueError(f"steps[{i}] must be one step name mapped to its parameters")
            ((kind, params),) = item.items()
            steps.append(config_class(str(kind)).model_validate(params or {}))
        return steps

    @model_validator(mode="after")
    def _possible_order(self) -> Recipe:
        problem = check_order(self.steps, start_forms(is_onnx_task(self.task)))
        if problem:
            raise ValueError(problem)
        return self

    def read(self, paths: tuple[str, ...]) -> dict[str, Any]:
        """The recipe fields named by dotted ``paths`` as JSON (``steps.KIND``: that step's
        configs), for the cache key of a step that declares it reads them."""
        out: dict[str, Any] = {}
        for path in paths:
            head, _, kind = path.partition(".")
            if head == "steps":
                out[path] = [s.key_dict() for s in self.steps if s.kind == kind]
                continue
            value: Any = self
            for part in path.split("."):
                value = getattr(value, part)
            out[path] = _key_json(value)
            if path in ("outputs", "metric"):  # what a hook computes depends on its code
                out[f"{path}.code"] = self._hook_code(path)
        return out

    def _hook_code(self, path: str) -> dict[str, str]:
        """Content hashes of the hook files the ``outputs`` or ``metric`` field names."""
        from .candidate import file_hash

        refs = (
            [self.metric]
            if path == "metric"
            else [d.decode for d in self.outputs.values() if isinstance(d, BoxesOutput)]
        )
        files = {r.rpartition(":")[0] for r in refs if r}
        return {f: file_hash(Path(f)) for f in sorted(files) if Path(f).is_file()}

    def judging(self) -> dict[str, Any]:
        """What a candidate's verdict depends on besides the budget: the output declarations
        and the metric hook (part of the key of every cached measurement and search)."""
        return self.read(("outputs", "metric"))

    @model_validator(mode="after")
    def _onnx_keys_need_onnx(self) -> Recipe:
        onnx_only: dict[str, Any] = {"eval_samples": self.eval_samples, "inputs": self.inputs}
        onnx_only["primary_output"] = self.primary_output
        onnx_only["metric"] = self.metric
        onnx_only["constant_inputs"] = self.constant_inputs
        given = [k for k, v in onnx_only.items() if v]
        if given and not self.task.endswith(".onnx"):
            raise ValueError(
                f"{given[0]} applies to an ONNX task (task: model.onnx); remove it for "
                f"task {self.task!r}"
            )
        return self

    def step_config(self, cls: type[S]) -> S:
        """The recipe's first step of config type ``cls``, or that step's defaults."""
        return next((s for s in self.steps if isinstance(s, cls)), None) or cls()

    def batch_axes(self) -> dict[str, int | None]:
        return {name: cfg.batch_axis for name, cfg in self.inputs.items()}

    def to_dict(self, explicit: bool = False) -> dict[str, Any]:
        """A plain dict that :func:`recipe_from_dict` turns back into an equal recipe: every
        field, or with ``explicit`` only those the recipe set (the round trip then keeps what
        was said apart from what was defaulted: a step may treat the two differently)."""
        data = self.model_dump(mode="json", exclude={"steps"}, exclude_unset=explicit)
        data["steps"] = [
            {s.kind: s.model_dump(mode="json", exclude_unset=explicit)} for s in self.steps
        ]
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _key_json(value: Any) -> Any:
    if isinstance(value, Config):
        return value.key_dict()
    if isinstance(value, dict):
        return {k: _key_json(v) for k, v in value.items()}
    return value


def is_onnx_task(spec: str) -> bool:
    """Whether a recipe's ``task`` names an ONNX file (the task then has no torch model)."""
    return spec.endswith(".onnx")


def _format_validation_error(err: ValidationError, origin: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = (
            "unknown key; remove it or check its spelling (see `slimline optimize --print-recipe`)"
        )
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"recipe {origin}: {where}: {msg}{more}"


def recipe_from_dict(data: Any, origin: str = "<dict>") -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(
            f"recipe {origin}: expected a mapping at the top level, got {type(data).__name__}"
        )
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_validation_error(err, origin)) from None
    except KeyError as err:  # unknown step name from the registry
        raise RecipeError(f"recipe {origin}: {err.args[0]}") from None


def load_recipe(path: str | Path) -> Recipe:
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe file {p} does not exist; pass a YAML recipe or an example name")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise RecipeError(
            f"recipe {p} is not valid YAML ({err.__class__.__name__}); fix its syntax"
        ) from None
    recipe = recipe_from_dict(data, str(p))
    # relative task/sample/hook paths are relative to the recipe file
    updates: dict[str, Any] = {}
    for key in ("task", "samples", "eval_samples"):
        val = getattr(recipe, key)
        if val and (val.endswith((".py", ".onnx", ".npz"))) and not Path(val).is_absolute():
            updates[key] = str((p.parent / val).resolve())
    if recipe.metric:
        updates["metric"] = _beside(p, recipe.metric)
    if any(isinstance(d, BoxesOutput) for d in recipe.outputs.values()):
        updates["outputs"] = {
            name: d.model_copy(update={"decode": _beside(p, d.decode)})
            if isinstance(d, BoxesOutput)
            else d
            for name, d in recipe.outputs.items()
        }
    return recipe.model_copy(update=updates) if updates else recipe


def _beside(recipe_file: Path, hook: str) -> str:
    """``file.py:function`` with a relative file resolved against the recipe's folder."""
    file, _, func = hook.rpartition(":")
    if Path(file).is_absolute():
        return hook
    return f"{(recipe_file.parent / file).resolve()}:{func}"
