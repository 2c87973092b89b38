"""Step registry: a step is a typed config plus one function ``candidate -> candidate``.

Handlers are registered by config *type* (the config class carries its recipe key in ``kind``), so
there is one table and nothing to keep in sync. Each registration declares:

- a :class:`Contract`: what the step consumes and produces (a torch model, a float ONNX graph, a
  quantized ONNX graph), so that :func:`check_order` rejects an impossible order before any work;
- what its cached result depends on besides its config and its input: the recipe fields it reads,
  its own ``version`` (bump it when the handler's output changes) and the packages it uses.

Adding a technique means writing one config class and one function decorated with :func:`step`
in a module under one of ``STEP_PACKAGES``; the registry finds it by scanning them. This module
depends only on the leaf modules (configs, candidate); it never imports a step module by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from ..candidate import Candidate
from ..config import StepConfig
from ..discover import import_all

__all__ = [
    "FORMS",
    "STEP_PACKAGES",
    "Contract",
    "Form",
    "StepSpec",
    "check_order",
    "config_class",
    "handler_for",
    "kinds_producing",
    "registered_kinds",
    "restorer_for",
    "spec_for",
    "start_forms",
    "step",
]

# where step modules live; a new module under these is found without being listed anywhere
STEP_PACKAGES: tuple[str, ...] = ("slimline.export", "slimline.compress")

Form = Literal["torch", "onnx", "onnx-int8"]
FORMS: dict[str, str] = {
    "torch": "a torch model",
    "onnx": "a float ONNX graph",
    "onnx-int8": "a quantized ONNX graph",
}

C = TypeVar("C", bound=StepConfig)
# handler(config, candidate, ctx: StepContext) -> candidate; the context is typed by the handler
StepFn = Callable[[C, Candidate, Any], Candidate]

# restore(entry_dir, meta, task) -> torch module: rebuilds the torch model a cached step produced
# (e.g. a pruned model) without pickles; steps whose outputs are ONNX-only need none.
Restore = Callable[[Any, dict[str, Any], Any], Any]


@dataclass(frozen=True)
class Contract:
    """What a step needs from its input candidate and what its output holds.

    ``consumes``: the input must hold one of these forms. ``produces``: forms the output holds.
    ``keeps``: forms of the input the output still holds (e.g. export keeps the torch model).
    ``once``: at most once per recipe. ``first``: runs before the other steps wherever it is
    listed (the export that makes the FP32 ONNX baseline).
    """

    consumes: tuple[Form, ...]
    produces: tuple[Form, ...]
    keeps: tuple[Form, ...] = ()
    once: bool = False
    first: bool = False

    def __post_init__(self) -> None:
        unknown = {*self.consumes, *self.produces, *self.keeps} - set(FORMS)
        if unknown:
            raise TypeError(f"unknown forms {sorted(unknown)}; known: {sorted(FORMS)}")

    def accepts(self, forms: frozenset[str]) -> bool:
        return bool(forms & set(self.consumes))

    def output(self, forms: frozenset[str]) -> frozenset[str]:
        """The forms a candidate holds after this step ran on one holding ``forms``."""
        return frozenset(self.produces) | (forms & set(self.keeps))


@dataclass(frozen=True)
class StepSpec:
    config: type[StepConfig]
    handler: Callable[..., Candidate]
    contract: Contract
    version: int = 1
    reads: tuple[str, ...] = ()  # recipe fields the result depends on, e.g. "bench", "steps.export"
    packages: tuple[str, ...] = ()  # distributions whose versions the result depends on
    restore: Restore | None = None


_SPECS: dict[type[StepConfig], StepSpec] = {}


def step(
    config_cls: type[C],
    *,
    contract: Contract,
    version: int = 1,
    reads: Iterable[str] = (),
    packages: Iterable[str] = (),
    restore: Restore | None = None,
) -> Callable[[StepFn[C]], StepFn[C]]:
    """Register ``fn`` as the handler of ``config_cls``, with its contract and cache-key parts
    (and ``restore`` for steps whose cached output includes a torch module)."""
    if not config_cls.kind:
        raise TypeError(f"{config_cls.__name__} must set the class attribute `kind`")

    def register(fn: StepFn[C]) -> StepFn[C]:
        for other in _SPECS:
            if other.kind == config_cls.kind and other is not config_cls:
                raise TypeError(f"step kind {config_cls.kind!r} registered twice")
        _SPECS[config_cls] = StepSpec(
            config_cls, fn, contract, version, tuple(reads), tuple(packages), restore
        )
        return fn

    return register


def _load_builtins() -> None:
    import_all(STEP_PACKAGES)


def registered_kinds() -> list[str]:
    _load_builtins()
    return sorted(c.kind for c in _SPECS)


def kinds_producing(form: Form) -> frozenset[str]:
    """The kinds of the registered steps whose contract says their output holds ``form`` (every
    INT8 technique, for ``"onnx-int8"``): a new technique is one by its contract alone."""
    _load_builtins()
    return frozenset(cls.kind for cls, spec in _SPECS.items() if form in spec.contract.produces)


def config_class(kind: str) -> type[StepConfig]:
    _load_builtins()
    for cls in _SPECS:
        if cls.kind == kind:
            return cls
    raise KeyError(f"unknown step {kind!r}; known steps: {', '.join(registered_kinds())}")


def spec_for(config: StepConfig | type[StepConfig]) -> StepSpec:
    _load_builtins()
    cls = config if isinstance(config, type) else type(config)
    try:
        return _SPECS[cls]
    except KeyError:
        raise KeyError(f"no handler registered for {cls.__name__}") from None


def handler_for(config: StepConfig) -> Callable[..., Candidate]:
    return spec_for(config).handler


def restorer_for(config: StepConfig) -> Restore | None:
    return spec_for(config).restore


def start_forms(onnx_task: bool) -> frozenset[str]:
    """What the first step can start from: an ONNX task's float graph, or the pipeline's two
    baselines of a torch task (its model, and the verified float export every run makes)."""
    return frozenset({"onnx"} if onnx_task else {"torch", "onnx"})


def _text(forms: Iterable[str]) -> str:
    return " or ".join(FORMS[f] for f in sorted(forms)) or "nothing"


def check_order(steps: list[StepConfig], start: frozenset[str]) -> str | None:
    """Why ``steps`` cannot run in this order from a task holding ``start``, or ``None``.

    Any step may be rejected at run time (its successor then starts from its parent), so every
    step must accept every state the steps before it can leave, accepted or rejected.
    """
    order = sorted(range(len(steps)), key=lambda i: not spec_for(steps[i]).contract.first)
    states: dict[frozenset[str], str] = {start: "the task"}  # state -> the step that left it
    seen: set[str] = set()
    for i in order:
        cfg, contract = steps[i], spec_for(steps[i]).contract
        if contract.once and cfg.kind in seen:
            return f"steps[{i}] {cfg.kind}: a recipe runs {cfg.kind} once; remove the repeat"
        seen.add(cfg.kind)
        for forms, origin in states.items():
            if not contract.accepts(forms):
                return _mismatch(f"steps[{i}] {cfg.kind}", contract, forms, origin)
        after = {contract.output(f): f"steps[{i}] {cfg.kind}" for f in states}
        # a state reached before keeps the origin that first left it (the earliest cause)
        states = {**after, **states} if not contract.first else after
    return None


def _mismatch(where: str, contract: Contract, forms: frozenset[str], origin: str) -> str:
    needs, kind = _text(contract.consumes), where.split(" ")[-1]
    if origin == "the task":
        return f"{where} needs {needs}, but the task gives {_text(forms)}; remove {kind}"
    before = origin.split(" ")[-1]
    fix = "remove the repeat" if before == kind else f"put {kind} before {before}"
    return f"{where} needs {needs}, but after {origin} the candidate holds {_text(forms)}; {fix}"
