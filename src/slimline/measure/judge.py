"""The judge of declared outputs: a recipe's ``outputs:`` declarations (:mod:`slimline.outputs`)
with their decode functions loaded, checked once against the FP32 reference outputs, then
scoring every candidate's outputs against FP32's (:mod:`.kinds`).

The check against FP32 runs before any candidate is judged: a declared name that is not an
output, a kind that does not fit the output's shape, and a decode function that finds no boxes
in FP32's own outputs are errors there, since nothing could be compared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import RecipeError, TaskError
from ..hooks import load_hook
from ..outputs import BoxesOutput, CtcOutput, LogitsOutput, OutputDecl, ProbabilityMapOutput, misfit
from .kinds import box_match, ctc_score, logits_score, map_score

__all__ = ["Judge", "decode_boxes"]

Outputs = Mapping[str, np.ndarray]


@dataclass
class Judge:
    declared: dict[str, OutputDecl]
    decoders: dict[str, Callable[..., Any]] = field(default_factory=dict)

    @classmethod
    def from_declarations(cls, declared: Mapping[str, OutputDecl]) -> Judge | None:
        if not declared:
            return None
        decoders = {
            name: load_hook(d.decode, f"outputs.{name}.decode")
            for name, d in declared.items()
            if isinstance(d, BoxesOutput)
        }
        return cls(dict(declared), decoders)

    def check_reference(self, ref: Outputs) -> None:
        """Errors for declarations FP32's outputs cannot be judged by (see the module doc)."""
        for name, decl in self.declared.items():
            if name not in ref:
                raise RecipeError(
                    f"recipe outputs: {name!r} is not an output of the model (its outputs: "
                    f"{', '.join(ref)}); fix the name"
                )
            problem = misfit(name, decl.kind, ref[name].shape)
            if problem:
                raise RecipeError(f"recipe outputs: {problem}")
            if isinstance(decl, BoxesOutput):
                boxes = decode_boxes(self.decoders[name], ref, name, decl.decode)
                if not sum(len(b) for b in boxes):
                    raise TaskError(
                        f"recipe outputs.{name}: {decl.decode} returned no boxes for the FP32 "
                        f"model on any of the {len(boxes)} evaluation rows, so no candidate's "
                        "boxes could be compared; check the decode function (its score "
                        "threshold, the output layout) or evaluate on rows with objects"
                    )

    def score(self, outs: Outputs, ref: Outputs) -> dict[str, dict[str, Any]]:
        """Per declared output: its kind, ``agreement`` and the kind's figures; a decode
        function that fails on the candidate's outputs gives agreement 0 and its ``error``."""
        return {name: self._score_one(name, d, outs, ref) for name, d in self.declared.items()}

    def _score_one(
        self, name: str, decl: OutputDecl, outs: Outputs, ref: Outputs
    ) -> dict[str, Any]:
        out, want = outs[name], ref[name]
        if isinstance(decl, LogitsOutput):
            figures = logits_score(out, want)
        elif isinstance(decl, ProbabilityMapOutput):
            figures = map_score(out, want, decl.threshold)
        elif isinstance(decl, CtcOutput):
            figures = ctc_score(out, want, decl.blank)
        else:
            figures = self._boxes(name, decl, outs, ref)
        return {"kind": decl.kind, **figures}

    def _boxes(self, name: str, decl: BoxesOutput, outs: Outputs, ref: Outputs) -> dict[str, Any]:
        decode = self.decoders[name]
        want = decode_boxes(decode, ref, name, decl.decode)
        try:
            got = decode_boxes(decode, outs, name, decl.decode)
        except TaskError as err:
            return {"agreement": 0.0, "error": str(err)}
        return box_match(got, want, decl.iou)


def decode_boxes(
    decode: Callable[..., Any], outputs: Outputs, name: str, ref: str
) -> list[np.ndarray]:
    """``decode`` on each row (every output as a batch of one), as ``[K, 5]`` float arrays
    (x1, y1, x2, y2, class; a ``[K, 4]`` result is class 0)."""
    rows = len(outputs[name])
    boxes = []
    for i in range(rows):
        row = {k: v[i : i + 1] for k, v in outputs.items()}
        try:
            got = np.asarray(decode(row), dtype=np.float64)
        except Exception as err:
            raise TaskError(
                f"recipe outputs.{name}: {ref} failed on row {i}: {type(err).__name__}: {err}"
            ) from err
        boxes.append(_as_boxes(got, name, ref))
    return boxes


def _as_boxes(got: np.ndarray, name: str, ref: str) -> np.ndarray:
    if got.size == 0:
        return np.zeros((0, 5))
    if got.ndim != 2 or got.shape[1] < 4:
        raise TaskError(
            f"recipe outputs.{name}: {ref} returned shape {list(got.shape)}; it must return "
            "boxes [K, 5] (x1, y1, x2, y2, class) or [K, 4]"
        )
    if got.shape[1] == 4:
        return np.concatenate([got, np.zeros((len(got), 1))], axis=1)
    return got[:, :5]
