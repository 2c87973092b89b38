"""Content-addressed cache of step outputs and measurements.

A step's entry is a directory named by a hash of everything that determines its output (input
model hash, step config, data hashes, target, budget, package versions). It is built in a
temporary directory and renamed into place in one ``os.rename``, so an entry exists complete or
not at all: a run killed with SIGKILL leaves at most a ``tmp-*`` directory, removed on the next
start, and resumes from the last finished step.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .record import atomic_write_json

__all__ = ["StepCache"]

_STALE_SECONDS = 6 * 3600


class StepCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        (self.root / "steps").mkdir(parents=True, exist_ok=True)
        (self.root / "json").mkdir(parents=True, exist_ok=True)
        self._clean_stale()

    def _clean_stale(self) -> None:
        now = time.time()
        for tmp in (self.root / "steps").glob("tmp-*"):
            try:
                # a tmp dir of a live concurrent run is young; a killed run's is removed
                pid = int(tmp.name.split("-")[1])
                alive = _pid_alive(pid)
            except (ValueError, IndexError):
                alive = False
            if not alive or now - tmp.stat().st_mtime > _STALE_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _name(key: str) -> str:
        return key.split(":", 1)[-1][:40]

    def step_dir(self, key: str) -> Path | None:
        path = self.root / "steps" / self._name(key)
        return path if (path / "result.json").is_file() else None

    def build_step(self, key: str, build: Callable[[Path], dict[str, Any]]) -> Path:
        """Run ``build(tmpdir)`` (which returns the JSON result) and publish it under ``key``."""
        tmp = self.root / "steps" / f"tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            result = build(tmp)
            atomic_write_json(tmp / "result.json", result)
            final = self.root / "steps" / self._name(key)
            if final.exists():  # a concurrent run published the same key first
                shutil.rmtree(tmp)
            else:
                os.rename(tmp, final)
            return final
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def get_json(self, kind: str, key: str) -> Any | None:
        path = self.root / "json" / f"{kind}-{self._name(key)}.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            return None

    def put_json(self, kind: str, key: str, value: Any) -> None:
        atomic_write_json(self.root / "json" / f"{kind}-{self._name(key)}.json", value)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()
