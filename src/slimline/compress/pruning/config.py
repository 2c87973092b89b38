"""The ``prune`` step's configuration: the target, the sensitivity sweep, the rounds and their
recovery, and depth pruning (``layers``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ...recipe import StepConfig
from ..finetune import FinetuneConfig
from .depth import LayersConfig

__all__ = ["PruneConfig"]


class PruneConfig(StepConfig):
    kind: ClassVar[str] = "prune"
    not_in_key: ClassVar[frozenset[str]] = frozenset({"progress", "workers", "ray_address"})
    target: float = Field(0.3, gt=0.0, lt=1.0, description="share of MACs (or params) to remove")
    by: Literal["macs", "params"] = "macs"
    max_ratio: float = Field(0.8, gt=0.0, lt=1.0, description="no group pruned beyond this")
    ratios: list[float] = Field(
        default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
        description="ratios of the sensitivity sweep",
    )
    round_to: int = Field(8, ge=1, le=256, description="kept channels: a multiple of this")
    keep_first_last: bool = Field(
        True, description="keep the first layer whole (output layers always are)"
    )
    exclude: list[str] = Field(default_factory=list, description="module-name patterns kept whole")
    importance: Literal["auto", "magnitude", "taylor"] = Field(
        "auto", description="auto: Taylor with training data, L2 magnitude otherwise"
    )
    taylor_batches: int = Field(8, ge=1, le=1000)
    plan: dict[str, float] | None = Field(
        None, description="per-group ratios (from a run's manifest); skips sweep and planner"
    )
    rounds: int = Field(
        10, ge=1, le=100, description="pruning rounds, each followed by fine-tuning"
    )
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    final_steps: int | None = Field(
        None,
        ge=0,
        description="fine-tuning steps after the last round (default: finetune.steps); the "
        "final model is what ships, so its recovery is usually the one worth paying for",
    )
    sensitivity_samples: int = Field(1000, ge=1, description="evaluation rows for the sweep")
    fidelity_weight: float = Field(1.0, ge=0.0, description="weight of (1 - cosine) in the loss")
    workers: int = Field(
        0, ge=0, le=256, description="sweep processes: 0 = target threads, 1 = none"
    )
    ray_address: str | None = Field(None, description="run the sweep on this Ray cluster")
    example_batch: int = Field(2, ge=1, le=64)
    layers: LayersConfig | None = Field(
        None, description="drop whole layers of the encoder stack first (depth pruning)"
    )
    width: bool | None = Field(
        None,
        description="thin the layers (heads, FFN neurons, channels) to `target`; default: "
        "yes without `layers`, no with it",
    )
    progress: bool = True

    @model_validator(mode="after")
    def _prunes_something(self) -> PruneConfig:
        if self.width is False and self.layers is None:
            raise ValueError("width: false without layers prunes nothing; add layers: {drop: N}")
        return self

    def key_dict(self) -> dict[str, Any]:
        """Without ``layers`` and ``width`` while unset: a width-only step keeps the cache key
        it had before depth pruning existed (its result did not change)."""
        data = super().key_dict()
        for name in ("layers", "width"):
            if data.get(name) is None:
                data.pop(name, None)
        return data

    @property
    def thins(self) -> bool:
        """Whether the step prunes width (heads, neurons, channels) to ``target``."""
        return self.width if self.width is not None else self.layers is None

    @field_validator("ratios")
    @classmethod
    def _valid_ratios(cls, v: list[float]) -> list[float]:
        if not v or any(not 0.0 < r < 1.0 for r in v):
            raise ValueError(
                "ratios must be a non-empty list of values in (0, 1), e.g. [0.1, 0.2, 0.4]"
            )
        return sorted(set(v))
