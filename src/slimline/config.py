"""Base classes of every slimline config (a leaf module: the recipe and the step registry build
on it, and neither is imported here)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

__all__ = ["Config", "StepConfig"]


class Config(BaseModel):
    """Base of every slimline config: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # fields that do not change a result (progress bars, worker counts): left out of cache keys
    not_in_key: ClassVar[frozenset[str]] = frozenset()

    def key_dict(self) -> dict[str, Any]:
        """The config as JSON, without the fields that do not change a result."""
        data = self.model_dump(mode="json", exclude=set(self.not_in_key))
        for name in data:
            value = getattr(self, name)
            if isinstance(value, Config):
                data[name] = value.key_dict()
        return data


class StepConfig(Config):
    """Base of step configs. Subclasses set ``kind``, the key used in recipes."""

    kind: ClassVar[str] = ""
    version: int = 1
