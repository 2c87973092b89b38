"""A prune step's checkpoints in its work directory of the step cache: the sweep table, the
plan and every finished round (and the recovery of the round in progress), written atomically so
that a killed run resumes where it was."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...record import atomic_write_bytes, atomic_write_json
from ..finetune import FileCheckpoint

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import nn

__all__ = ["RoundState", "save_torch"]


class RoundState:
    """Checkpoint of a prune step in progress: sweep table, plan, finished rounds."""

    def __init__(self, root: Path) -> None:
        self.root = root
        path = root / "state.json"
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    @property
    def rounds_done(self) -> int:
        return int(self.data.get("rounds_done", 0))

    def save(self, **items: Any) -> None:
        self.data.update(items)
        atomic_write_json(self.root / "state.json", self.data)

    def save_round(
        self, i: int, model: nn.Module, history: list[list[Any]], records: list[dict[str, Any]]
    ) -> None:
        save_torch(self.root / f"round-{i}.pt", model.state_dict())
        self.save(rounds_done=i, history=history, records=records, partial=None)
        for old in [*self.root.glob("round-*.pt"), *self.root.glob("partial-*.pt")]:
            if old.name != f"round-{i}.pt":
                old.unlink(missing_ok=True)

    def start_round(
        self, i: int, history: list[list[Any]], removed: dict[str, int], imp: str
    ) -> None:
        """Round ``i`` has pruned and starts recovering: what it removed, for a resume mid-way."""
        (self.root / f"partial-{i}.pt").unlink(missing_ok=True)
        self.save(partial={"round": i, "history": history, "removed": removed, "importance": imp})

    def partial(self) -> dict[str, Any] | None:
        """The unfinished round after the last finished one, if its recovery saved a checkpoint."""
        part = self.data.get("partial")
        if not part or part["round"] != self.rounds_done + 1:
            return None
        return part if (self.root / f"partial-{part['round']}.pt").is_file() else None

    def recovery(self, i: int) -> FileCheckpoint:
        return FileCheckpoint(self.root / f"partial-{i}.pt", "prune: recovery")

    def load_round(self) -> dict[str, Any]:
        import torch

        state: dict[str, Any] = torch.load(
            self.root / f"round-{self.rounds_done}.pt", weights_only=True
        )
        return state

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def save_torch(path: Path, obj: Any) -> None:
    """``torch.save`` of tensors and plain data, atomically (read back with weights_only)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())
