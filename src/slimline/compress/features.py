"""Hidden-state distillation: taps that collect the outputs of named modules during a forward
pass, and the relative feature loss between a student's and a teacher's."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..errors import RecipeError

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import Tensor, nn

__all__ = ["FeatureTap", "feature_loss", "first_output"]


def first_output(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


class FeatureTap:
    """Forward hooks that collect, in call order, the outputs of the modules of ``model`` whose
    names fully match ``pattern`` (the first element where a module returns a tuple)."""

    def __init__(self, model: nn.Module, pattern: str) -> None:
        rx = re.compile(pattern)
        names = [n for n, _ in model.named_modules() if n and rx.fullmatch(n)]
        if not names:
            raise RecipeError(
                f"finetune.features {pattern!r} matches no module of {type(model).__name__}; "
                "name modules by their dotted path, e.g. 'encoder\\.layer\\.\\d+'"
            )
        self._attach(model, names)

    @classmethod
    def of_names(cls, model: nn.Module, names: list[str]) -> FeatureTap:
        """A tap on the modules named ``names`` (each must exist)."""
        tap = cls.__new__(cls)
        tap._attach(model, names)
        return tap

    def _attach(self, model: nn.Module, names: list[str]) -> None:
        self.names = list(names)
        self.outputs: list[Tensor] = []
        mods = dict(model.named_modules())
        self._handles = [mods[n].register_forward_hook(self._hook) for n in self.names]

    def _hook(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        self.outputs.append(first_output(out))

    def take(self) -> list[Tensor]:
        out, self.outputs = self.outputs, []
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def feature_loss(
    student_feats: list[Tensor], teacher_feats: list[Tensor], names: list[str], mask: Tensor | None
) -> Tensor:
    """Mean over modules of the relative squared error ``|s - t|^2 / |t|^2`` of their outputs,
    over unpadded positions where the output is ``[N, L, ...]`` with an ``[N, L]`` mask. Relative,
    so every layer weighs the same whatever the scale of its activations."""
    if len(student_feats) != len(teacher_feats):
        raise RecipeError(
            f"finetune.features: the student ran {len(student_feats)} matching modules, the "
            f"teacher {len(teacher_feats)}; name modules that both models run once per forward"
        )
    total = None
    for name, s, t in zip(names, student_feats, teacher_feats, strict=True):
        if s.shape != t.shape:
            raise RecipeError(
                f"finetune.features: module {name} outputs {tuple(s.shape)} in the student but "
                f"{tuple(t.shape)} in the teacher; match only modules whose outputs pruning keeps "
                "(e.g. whole encoder layers, not their pruned projections)"
            )
        d2, t2 = (s.float() - t.float().detach()) ** 2, t.float().detach() ** 2
        if mask is not None and tuple(s.shape[:2]) == tuple(mask.shape):
            w = mask.to(d2.dtype).reshape(*mask.shape, *([1] * (s.dim() - 2)))
            d2, t2 = d2 * w, t2 * w
        term = d2.sum() / t2.sum().clamp(min=1e-12)
        total = term if total is None else total + term
    assert total is not None
    return total / len(names)
