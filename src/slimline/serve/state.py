"""What one server holds: its settings, and a slot per served model version.

A :class:`Slot` is one model version with its own batcher, model monitor and count of requests
inside it. Each model name has a default version (what ``/v2/models/{name}`` serves); the other
loaded versions answer at ``/v2/models/{name}/versions/{version}``. Models given on the command
line have one version each; a model repository (:mod:`slimline.serve.repository`) adds, swaps
and retires versions while the server runs. A request holds its slot from look-up to answer, so
a retired version finishes what it took (:meth:`ServerState.retire` waits for it) and the next
request finds the new default.

Readiness: live and ready once the command-line models are warm and the repository's first load
is done; a repository version that failed to load is listed (``unavailable``) but does not hold
readiness back while its model has another version serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, SecretStr

from ..recipe import Config
from .batcher import BatcherConfig, DynamicBatcher
from .metrics import ModelObserver, ServeMetrics
from .model import ServedModel
from .monitor import (
    ModelMonitor,
    MonitorMetrics,
    count_warnings,
    find_reference,
    float_fallbacks,
    references_for,
)
from .protocol import ProtocolError

__all__ = ["ServeSettings", "ServerState", "Slot", "example_inputs"]

log = logging.getLogger(__name__)


class ServeSettings(Config):
    """Everything the server needs besides its models (the CLI builds one of these)."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    batching: BatcherConfig = Field(default_factory=BatcherConfig)
    threads: int = Field(1, ge=1, le=256, description="ONNX Runtime intra-op threads per batch")
    ort_spinning: bool = Field(False, description="let idle ONNX Runtime threads spin-wait")
    api_token: SecretStr | None = None
    max_body_bytes: int = Field(64 << 20, ge=1024)
    allow_nonfinite: bool = False
    drain_timeout_s: float = Field(30.0, gt=0.0)
    processing_threads: int = Field(2, ge=1, le=64, description="pool for pre/post-processing")
    drift_window: int = Field(
        1000, ge=10, le=1_000_000, description="live rows the drift score compares"
    )
    grpc_port: int | None = Field(
        None, ge=0, le=65535, description="also serve the protocol over gRPC here (0: any port)"
    )
    repository: Path | None = Field(None, description="a model repository: <model>/<version>/")
    version_policy: str = Field("latest:1", description="latest:N, all, or specific:1,3")
    gate: bool = Field(False, description="gate a new version with `slimline check` first")


@dataclass(eq=False)
class Slot:
    """One served model version: its batcher, its monitor, the requests inside it."""

    model: ServedModel
    batcher: DynamicBatcher
    monitor: ModelMonitor
    warm: bool = False
    inflight: int = 0

    @property
    def version(self) -> str:
        return self.model.version


class ServerState:
    """Models, their versions' slots and the readiness flags of one app."""

    def __init__(self, models: list[ServedModel], settings: ServeSettings) -> None:
        self.settings = settings
        self.metrics = ServeMetrics(settings.batching.max_batch_size)
        self.monitor_metrics = MonitorMetrics(self.metrics.registry)
        self.observers: dict[str, ModelObserver] = {}
        self.slots: dict[str, dict[str, Slot]] = {}
        self.default: dict[str, str] = {}  # model name -> its default version
        self.warmup_error: str | None = None
        self.draining = False
        self.processing = ThreadPoolExecutor(settings.processing_threads, "pre-post")
        self.on_fatal: Callable[[], None] | None = None  # e.g. stop the HTTP server
        self.grpc: Any = None  # a grpc_server.GrpcFrontEnd, once the app's lifespan starts it
        self.repository: Any = None  # a repository.Repository when serving one
        self._static = list(models)
        self._warmup: asyncio.Task[None] | None = None

    # -- views ----------------------------------------------------------------------------
    @property
    def models(self) -> dict[str, ServedModel]:
        """Each model name's default version."""
        return {n: self.slots[n][v].model for n, v in self.default.items()}

    @property
    def batchers(self) -> dict[str, DynamicBatcher]:
        """Each model name's default version's batcher."""
        return {n: self.slots[n][v].batcher for n, v in self.default.items()}

    def all_slots(self) -> list[Slot]:
        return [s for versions in self.slots.values() for s in versions.values()]

    @property
    def ready(self) -> bool:
        static = all(self._default_warm(m.name) for m in self._static)
        repo = self.repository is None or self.repository.started
        return not self.draining and static and repo and self.healthy

    def _default_warm(self, name: str) -> bool:
        version = self.default.get(name)
        return version is not None and self.slots[name][version].warm

    @property
    def healthy(self) -> bool:
        """False once a model's batcher has died: nothing can be served until a restart."""
        return self.problem is None

    @property
    def problem(self) -> str | None:
        """Why the server is unhealthy (failed warm-up or a dead batcher), or None."""
        if self.warmup_error:
            return self.warmup_error
        for slot in self.all_slots():
            if slot.batcher.failure is not None:
                return f"the batcher of model {slot.model.name!r} stopped ({slot.batcher.failure})"
        return None

    @property
    def degraded(self) -> str | None:
        """Why a cascade answers from its edge tier alone (its cloud is unavailable), or None."""
        return next((m.cascade.degraded for m in self.models.values()
                     if m.cascade is not None and m.cascade.degraded), None)  # fmt: skip

    def unavailable(self) -> list[dict[str, str]]:
        """Repository versions that failed to load or were refused, with the reason."""
        return [] if self.repository is None else self.repository.unavailable_list()

    def find(self, name: str, version: str | None) -> Slot:
        """The slot serving ``name`` (at ``version``, else its default); a 404 if none."""
        versions = self.slots.get(name)
        if not versions or name not in self.default:
            served = ", ".join(sorted(self.default)) or "nothing"
            raise ProtocolError(f"unknown model {name!r}; this server serves: {served}", 404)
        slot = versions.get(version or self.default[name])
        if slot is None:
            raise ProtocolError(
                f"model {name!r} has no version {version!r}; the served versions are "
                f"{', '.join(sorted(versions))}",
                404,
            )
        return slot

    def model_ready(self, name: str, version: str | None = None) -> bool:
        try:
            slot = self.find(name, version)
        except ProtocolError:
            return False
        return slot.warm and not self.draining and slot.batcher.failure is None

    def extensions(self) -> list[str]:
        """Protocol extensions beyond binary tensors (the model repository, when served)."""
        return ["model_repository"] if self.repository is not None else []

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The v2 repository index: one entry per model version, with its state and reason."""
        if self.repository is not None:
            return list(self.repository.index(ready_only))
        return [
            {"name": s.model.name, "version": s.version, "state": "READY", "reason": ""}
            for s in self.all_slots()
            if s.warm or not ready_only
        ]

    async def repository_action(self, action: str, name: str) -> None:
        """``load`` or ``unload`` a model of the repository (a ProtocolError when refused)."""
        if self.repository is None:
            raise ProtocolError(
                f"this server has no model repository, so it cannot {action} {name!r}; start it "
                "with --repository DIR",
                501,
            )
        await self.repository.act(action, name)

    # -- slots ----------------------------------------------------------------------------
    def add_slot(self, model: ServedModel) -> Slot:
        """A started batcher and a monitor for ``model`` (not yet warm, not yet a default)."""
        cfg = self.settings.batching
        fixed = model.fixed_batch()
        if fixed is not None:
            cfg = cfg.model_copy(update={"max_batch_size": fixed})
        observer = self.observers.get(model.name)
        if observer is None:
            observer = self.observers[model.name] = self.metrics.add_model(model.name)
        monitor = self._monitor(model)
        run = count_warnings(model.backend.run, monitor)
        batcher = DynamicBatcher(run, cfg, stack=fixed is None, observer=observer, name=model.name)
        batcher.start()
        slot = Slot(model, batcher, monitor)
        self.slots.setdefault(model.name, {})[model.version] = slot
        return slot

    def _monitor(self, model: ServedModel) -> ModelMonitor:
        outputs = [o.name for o in model.backend.outputs]
        primary = outputs[0] if model.meta.get("output_kind") == "logits" else None
        path = model.meta.get("monitor_reference") or find_reference(model.source)
        refs = references_for(None if path is None else Path(path), outputs, primary)
        return self.monitor_metrics.add_model(
            model.name, model.version, outputs, refs, self.settings.drift_window
        )

    async def warm_slot(self, slot: Slot) -> None:
        """Run the slot's model at every batch size it will see; raises what the model raised."""
        loop = asyncio.get_running_loop()
        model = slot.model
        for size in slot.batcher.batch_sizes():
            await loop.run_in_executor(
                self.processing, model.backend.run, example_inputs(model, size)
            )
        slot.warm = True
        log.info("model %s version %s warm (batch sizes %s)", model.name, model.version,
                 slot.batcher.batch_sizes())  # fmt: skip

    async def retire(self, slot: Slot) -> None:
        """Take a version out of service: once no request holds it (within the drain timeout),
        answer what is queued, drop its series and forget it. Route traffic away first."""
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while slot.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await slot.batcher.close(drain=True)
        slot.monitor.remove()
        versions = self.slots.get(slot.model.name, {})
        if versions.get(slot.version) is slot:
            del versions[slot.version]
        if not versions:
            self.slots.pop(slot.model.name, None)

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        for model in self._static:
            self.add_slot(model)
            self.default[model.name] = model.version
            if model.cascade is not None:
                await model.cascade.start(self.metrics.registry, model.name)
        self._warmup = asyncio.get_running_loop().create_task(self._warm_up())

    async def _warm_up(self) -> None:
        for model in self._static:
            try:
                await self.warm_slot(self.slots[model.name][model.version])
            except Exception as err:
                self.warmup_error = (
                    f"warm-up of model {model.name!r} failed ({err}); check that the model runs "
                    "with ONNX Runtime on this machine"
                )
                log.error("%s", self.warmup_error)
                if self.on_fatal is not None:
                    self.on_fatal()
                return
        if self.repository is not None:
            await self.repository.start()
        for slot in self.all_slots():
            await self.count_fallbacks(slot)

    async def count_fallbacks(self, slot: Slot) -> None:
        """Count the quantized ops ONNX Runtime runs as float kernels (kind ``float_fallback``);
        after warm-up, so readiness never waits for it."""
        model = slot.model
        path = getattr(model.backend, "path", None)
        if path is None or model.meta.get("runtime", "onnxruntime") != "onnxruntime":
            return
        loop = asyncio.get_running_loop()
        try:
            fallback = await loop.run_in_executor(self.processing, float_fallbacks, Path(path))
        except Exception as err:  # a report, not a reason to stop serving
            log.warning("could not inspect the kernels of model %s: %s", model.name, err)
            return
        if fallback:
            slot.monitor.warning("float_fallback", fallback)
            log.warning("model %s: %d quantized ops run as float kernels", model.name, fallback)

    async def warmed(self) -> None:
        """Wait for warm-up; raises if it failed."""
        if self._warmup is not None:
            await asyncio.shield(self._warmup)
        if self.warmup_error:
            raise RuntimeError(self.warmup_error)

    async def stop(self) -> None:
        """Refuse new work, answer everything queued, then release the pools."""
        self.draining = True
        if self._warmup is not None and not self._warmup.done():
            self._warmup.cancel()
        closing = [s.batcher.close(drain=True) for s in self.all_slots()]
        if self.grpc is not None:  # in-flight calls finish while the queues drain
            closing.append(self.grpc.stop(self.settings.drain_timeout_s))
        await asyncio.gather(*closing)
        for model in self._static:
            if model.cascade is not None:
                await model.cascade.close()
        self.processing.shutdown(wait=True)


def example_inputs(model: ServedModel, batch: int) -> dict[str, np.ndarray]:
    """Ones of each input's dtype; ``batch`` rows; free non-batch dimensions set to 1."""
    out = {}
    for spec in model.backend.inputs:
        dims = [d if d is not None else 1 for d in spec.shape]
        if model.batchable:
            dims[0] = batch
        out[spec.name] = np.ones(dims, dtype=spec.dtype)
    return out
