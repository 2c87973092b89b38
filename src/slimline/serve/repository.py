"""A versioned model repository: ``DIR/<model>/<version>/``, loaded, swapped and unloaded live.

Each version folder holds a run directory's files (``manifest.json`` and its selected artifact,
as ``slimline publish`` writes them) or one ``.onnx`` file; versions are whole numbers. The
version policy picks what is served: ``latest:N`` (default ``latest:1``), ``all``, or
``specific:1,3``. The highest loaded version is the default for ``/v2/models/{name}``.

Loading a model (at start-up, or ``POST /v2/repository/models/{name}/load`` / gRPC
``RepositoryModelLoad``) loads each wanted version not yet served, warms it, and, with
``--gate``, runs ``slimline check`` of its manifest against the serving default's; only then
does it become the default. Versions the policy no longer wants are retired after the switch:
requests already inside them finish there. A version that fails to load is listed as
``UNAVAILABLE`` with its reason (the index, ``/v2/health/ready``); the others keep serving. A
version whose gate fails is refused with the gate's line (HTTP 400 / ``INVALID_ARGUMENT``) and
the serving version stays.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ServeError, SlimlineError
from .model import ServedModel, make_backend, resolve_model_path, with_int8_kind_note
from .protocol import ProtocolError

if TYPE_CHECKING:
    from .state import ServerState, Slot

__all__ = ["Repository", "gate_line", "load_version", "parse_policy", "version_dirs"]

log = logging.getLogger(__name__)


def parse_policy(text: str) -> tuple[str, list[int]]:
    """``("latest", [N])``, ``("all", [])`` or ``("specific", [v, ...])`` from the flag text."""
    kind, _, rest = text.strip().partition(":")
    try:
        numbers = [int(x) for x in rest.split(",") if x.strip()]
    except ValueError:
        numbers = []
    if kind == "all" and not rest:
        return "all", []
    if kind == "latest" and len(numbers) == 1 and numbers[0] >= 1:
        return "latest", numbers
    if kind == "specific" and numbers and all(n >= 1 for n in numbers):
        return "specific", sorted(set(numbers))
    raise ServeError(f"version policy {text!r}: give latest:N, all, or specific:1,3")


def version_dirs(model_dir: Path) -> dict[int, Path]:
    """The version folders of a model folder, by number (other entries are ignored)."""
    if not model_dir.is_dir():
        return {}
    return {int(p.name): p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()}


def load_version(path: Path, name: str, version: int, threads: int) -> ServedModel:
    """A version folder as a served model: a run directory's selected artifact, or its one
    ``.onnx`` file."""
    if (path / "manifest.json").is_file():
        _, onnx_path, meta = resolve_model_path(path)
    else:
        found = sorted(path.glob("*.onnx"))
        if len(found) != 1:
            raise ServeError(
                f"{path} holds {len(found)} .onnx files and no manifest.json; put one model "
                "(or a run directory's files) in each version folder"
            )
        onnx_path, meta = found[0], {"source": str(path)}
    runtime = meta.get("runtime") or "onnxruntime"
    meta = with_int8_kind_note(f"{name} version {version}", meta)
    backend = make_backend(onnx_path, threads, runtime)
    return ServedModel(name, backend, version=str(version), source=str(path),
                       meta={**meta, "runtime": runtime})  # fmt: skip


def gate_line(candidate: Path, serving: Path) -> str | None:
    """The first regression line of ``slimline check`` of ``candidate``'s manifest against
    ``serving``'s (None: passed, or either is not a run directory)."""
    from ..gate import compare_manifests

    paths = (candidate / "manifest.json", serving / "manifest.json")
    if not all(p.is_file() for p in paths):
        return None
    current, baseline = (json.loads(p.read_text()) for p in paths)
    regressions, _ = compare_manifests(current, baseline)
    return str(regressions[0]) if regressions else None


class Repository:
    """The repository of one server; every load and unload runs under one lock."""

    def __init__(self, state: ServerState, root: Path, policy: str, *, gate: bool) -> None:
        if not Path(root).is_dir():
            raise ServeError(f"model repository {root} is not a folder; create it or fix the path")
        self.state = state
        self.root = Path(root)
        self.policy = parse_policy(policy)
        self.gate = gate
        self.started = False
        self.failed: dict[tuple[str, str], str] = {}  # (model, version) -> why unavailable
        self._lock = asyncio.Lock()

    def models_on_disk(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and version_dirs(p))

    def wanted(self, name: str) -> list[int]:
        on_disk = sorted(version_dirs(self.root / name))
        kind, numbers = self.policy
        if kind == "latest":
            return on_disk[-numbers[0] :]
        if kind == "specific":
            return [v for v in on_disk if v in numbers]
        return on_disk

    async def start(self) -> None:
        """Load every model on disk; failures are recorded, not raised."""
        try:
            for name in self.models_on_disk():
                try:
                    await self.act("load", name)
                except ProtocolError as err:
                    log.error("model %s: %s", name, err)
        finally:  # readiness never waits on a load that broke unexpectedly (it is logged)
            self.started = True

    async def act(self, action: str, name: str) -> None:
        if action not in ("load", "unload"):
            raise ProtocolError(f"unknown repository action {action!r}; use load or unload")
        async with self._lock:
            await (self._load(name) if action == "load" else self._unload(name))

    # -- load -------------------------------------------------------------------------------
    async def _load(self, name: str) -> None:
        versions = self.wanted(name)
        if not versions:
            raise ProtocolError(
                f"model {name!r} has no version folders in {self.root}; add "
                f"{self.root / name}/1/ (or `slimline publish`)",
                404,
            )
        served = self.state.slots.get(name, {})
        problems = []
        for v in versions:
            if str(v) not in served:
                problem = await self._load_version(name, v)
                if problem:
                    problems.append(problem)
        ready = [v for v in versions if str(v) in self.state.slots.get(name, {})]
        if ready:
            self._switch(name, str(max(ready)))
            for slot in list(self.state.slots.get(name, {}).values()):
                if int(slot.version) not in versions:
                    self.failed.pop((name, slot.version), None)
                    await self.state.retire(slot)
        if problems:
            raise ProtocolError("; ".join(problems), 400)

    async def _load_version(self, name: str, version: int) -> str | None:
        """Load, warm and gate one version; the reason it is unavailable, or None."""
        path = self.root / name / str(version)
        loop = asyncio.get_running_loop()
        threads = self.state.settings.threads
        try:
            model = await loop.run_in_executor(
                self.state.processing, load_version, path, name, version, threads
            )
        except (SlimlineError, OSError, RuntimeError, ValueError) as err:
            return self._mark(name, version, f"failed to load: {err}")
        try:
            slot = self.state.add_slot(model)  # reads the drift reference, if any
        except (SlimlineError, OSError, ValueError) as err:
            return self._mark(name, version, f"failed to start: {err}")
        try:
            await self.state.warm_slot(slot)
        except Exception as err:
            await self.state.retire(slot)
            return self._mark(name, version, f"failed warm-up: {err}")
        line = self._gate(name, path)
        if line is not None:
            await self.state.retire(slot)
            return self._mark(name, version, f"gate failed against the serving version: {line}")
        self.failed.pop((name, str(version)), None)
        asyncio.get_running_loop().create_task(self.state.count_fallbacks(slot))
        return None

    def _gate(self, name: str, candidate: Path) -> str | None:
        default = self.state.default.get(name)
        if not self.gate or default is None:
            return None
        return gate_line(candidate, Path(self.state.slots[name][default].model.source))

    def _mark(self, name: str, version: int, reason: str) -> str:
        self.failed[(name, str(version))] = reason
        log.error("model %s version %d %s", name, version, reason)
        return f"model {name!r} version {version} {reason}"

    def _switch(self, name: str, version: str) -> None:
        if self.state.default.get(name) != version:
            log.info("model %s: version %s is now the default", name, version)
        self.state.default[name] = version

    # -- unload -----------------------------------------------------------------------------
    async def _unload(self, name: str) -> None:
        slots: list[Slot] = list(self.state.slots.get(name, {}).values())
        if not slots and name not in self.models_on_disk():
            raise ProtocolError(f"model {name!r} is not in the repository {self.root}", 404)
        self.state.default.pop(name, None)  # new requests get 404 from now on
        await asyncio.gather(*(self.state.retire(s) for s in slots))

    # -- index ------------------------------------------------------------------------------
    def index(self, ready_only: bool = False) -> Iterator[dict[str, str]]:
        for name in self.models_on_disk():
            served = self.state.slots.get(name, {})
            for v in sorted(version_dirs(self.root / name)):
                entry = self._entry(name, str(v), served.get(str(v)))
                if entry["state"] == "READY" or not ready_only:
                    yield entry

    def _entry(self, name: str, version: str, slot: Any) -> dict[str, str]:
        if slot is not None:
            state = "READY" if slot.warm else "LOADING"
            return {"name": name, "version": version, "state": state, "reason": ""}
        reason = self.failed.get((name, version), "unloaded")
        return {"name": name, "version": version, "state": "UNAVAILABLE", "reason": reason}

    def unavailable_list(self) -> list[dict[str, str]]:
        return [{"name": n, "version": v, "reason": r} for (n, v), r in sorted(self.failed.items())]
