"""Content-addressed cache of step outputs and measurements.

A step's entry is a directory named by a hash of everything that determines its output (the
step's config, its input's content hash, the task's data, the recipe fields the step reads, the
step's own version and its packages' versions; see :func:`slimline.context.step_key_parts`). It is
built in a temporary directory and renamed into place in one ``os.rename``, so an entry exists
complete or not at all: a run killed with SIGKILL leaves at most a ``tmp-*`` directory, removed on
the next start, and resumes from the last finished step. Two runs that build the same entry at
once both succeed: the second to finish finds the first's entry and uses it.

A step may also keep JSON results (:meth:`get_json`) and resumable state (:meth:`work_dir`)
under keys made the same way.
"""

from __future__ import annotations

import errno
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
_LIVE_TMP: set[str] = set()  # names of the temp dirs this process is building into now


class StepCache:
    def __init__(self, root: Path) -> None:
        # absolute: steps hand work paths to child processes and runtimes that run elsewhere
        # (a relative --cache once broke the quantize step's prepared-model path)
        self.root = Path(root).absolute()
        (self.root / "steps").mkdir(parents=True, exist_ok=True)
        (self.root / "json").mkdir(parents=True, exist_ok=True)
        (self.root / "work").mkdir(parents=True, exist_ok=True)
        self._clean_stale()

    def _clean_stale(self) -> None:
        now = time.time()
        for tmp in (self.root / "steps").glob("tmp-*"):
            try:
                # a tmp dir of a live concurrent run is young; a killed run's is removed
                pid = int(tmp.name.split("-")[1])
                alive = _tmp_alive(tmp, pid)
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
        _LIVE_TMP.add(tmp.name)
        try:
            result = build(tmp)
            atomic_write_json(tmp / "result.json", result)
            return self._publish(tmp, self.root / "steps" / self._name(key))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            _LIVE_TMP.discard(tmp.name)

    @staticmethod
    def _publish(tmp: Path, final: Path) -> Path:
        """Rename ``tmp`` to ``final``; where a concurrent run published ``final`` first (the
        rename then fails with ENOTEMPTY or EEXIST), drop ``tmp`` and use the winner's entry."""
        try:
            os.rename(tmp, final)
        except OSError as err:
            if (
                err.errno not in (errno.ENOTEMPTY, errno.EEXIST)
                or not (final / "result.json").is_file()
            ):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def work_dir(self, key: str) -> Path:
        """A directory kept across runs for a step's resumable state under ``key`` (the step
        removes it when it finishes); made on demand."""
        path = self.root / "work" / self._name(key)
        path.mkdir(parents=True, exist_ok=True)
        return path

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


def _tmp_alive(tmp: Path, pid: int) -> bool:
    """Whether the run that made ``tmp`` may still be building into it. This process's own temp
    dirs are alive while it builds into them (another StepCache in the same process must not
    delete them); one left by an earlier process that had this PID is not."""
    if pid == os.getpid():
        return tmp.name in _LIVE_TMP
    return _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
