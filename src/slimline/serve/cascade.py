"""An edge-cloud cascade: the edge model answers every request; the rows it is unsure of go to
the cloud model, whose answer is returned.

``slimline serve --cascade EDGE CLOUD`` serves the edge model under its own name with a
:class:`Cascade` attached. After the edge tier's batcher answers, :meth:`Cascade.refine` scores
each row (:mod:`slimline.edge.scores`), sends the rows below the threshold to the cloud tier
(a local model with its own batcher, or a KServe v2 server over HTTP) and puts its rows in
their place. A cloud tier that fails, times out, rejects (a full queue) or is unreachable never
fails the request: the edge answer is returned, marked in the response's ``parameters``.

The two tiers must have the same outputs (names, dtypes, fixed dimensions): checked at start-up,
a one-line error. A cloud URL that cannot be reached at start-up is not an error: the server
starts, answers from the edge and reports itself degraded on ``/v2/health/ready`` until a probe
(every ``probe_interval_s``) finds the cloud again.

Metrics (in the server's registry): ``slimline_cascade_rows_total{model,route}`` (route: edge,
cloud, fallback), ``slimline_cascade_escalation_ratio{model}``,
``slimline_cascade_tier_duration_seconds{model,tier}`` (edge, cloud),
``slimline_cascade_cloud_failures_total{model,kind}`` (error, timeout, rejected, unavailable),
``slimline_cascade_degraded{model}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import Field

from ..config import Config
from ..edge.scores import ScoreFn, resolve_score
from ..errors import CloudError, ServeError
from .batcher import BatcherConfig, BatcherError, DynamicBatcher, QueueFull
from .metrics import LATENCY_BUCKETS
from .model import InferenceBackend, ServedModel, TensorSpec
from .protocol import NP_TO_V2, V2_TO_NP

__all__ = [
    "Cascade",
    "CascadeConfig",
    "LocalCloud",
    "RemoteCloud",
    "attach_cascade",
    "check_outputs",
    "load_threshold",
]

log = logging.getLogger(__name__)
Tensors = dict[str, np.ndarray]
ROUTES = ("edge", "cloud", "fallback")
FAILURES = ("error", "timeout", "rejected", "unavailable")


class CascadeConfig(Config):
    """How the edge decides to escalate, and how long the cloud may take."""

    threshold: float = Field(description="rows whose confidence score is below this escalate")
    score: str = Field("softmax", description="softmax, probability, margin or FILE.py:FUNCTION")
    output: str | None = Field(None, description="the output scored (default: the first)")
    cloud_timeout_ms: float = Field(1000.0, gt=0.0)
    probe_interval_s: float = Field(5.0, gt=0.0)


def load_threshold(value: str) -> dict[str, Any]:
    """``--cascade-threshold``: a number, or the JSON ``slimline cascade calibrate`` wrote
    (its ``threshold`` and ``score``)."""
    try:
        return {"threshold": float(value)}
    except ValueError:
        pass
    path = Path(value)
    if not path.is_file():
        raise ServeError(
            f"--cascade-threshold {value!r} is neither a number nor a calibration file; give "
            "one, or run `slimline cascade calibrate`"
        )
    try:
        doc = json.loads(path.read_text())
        fields = {"threshold": float(doc["threshold"]), "score": str(doc["score"])}
    except (ValueError, KeyError, TypeError):
        raise ServeError(
            f"{path} has no threshold and score; pass the JSON `slimline cascade calibrate` wrote"
        ) from None
    if doc.get("output"):
        fields["output"] = str(doc["output"])
    return fields


# -- compatibility --------------------------------------------------------------------------
def _describe(specs: list[TensorSpec]) -> str:
    def dims(s: TensorSpec) -> str:
        return ",".join("?" if d is None else str(d) for d in s.shape[1:])

    return "; ".join(f"{s.name} {s.dtype} [batch,{dims(s)}]" for s in specs)


def check_outputs(edge: list[TensorSpec], cloud: list[TensorSpec]) -> str | None:
    """Why the two tiers' outputs differ (names, dtypes, rank or a fixed non-batch dimension),
    or None when a cloud row can stand in for an edge row."""
    by_name = {s.name: s for s in cloud}
    if sorted(by_name) != sorted(s.name for s in edge):
        return f"the edge model's outputs ({_describe(edge)}) and the cloud's ({_describe(cloud)})"
    for e in edge:
        c = by_name[e.name]
        same_dims = len(e.shape) == len(c.shape) and all(
            a is None or b is None or a == b for a, b in zip(e.shape[1:], c.shape[1:], strict=False)
        )
        if e.dtype != c.dtype or not same_dims:
            return f"output {e.name}: edge {_describe([e])}, cloud {_describe([c])}"
    return None


def _mismatch_error(why: str) -> ServeError:
    return ServeError(
        f"cascade: {why} differ; serve an edge and a cloud model of the same task and outputs"
    )


# -- the cloud tier -------------------------------------------------------------------------
class CloudTier(Protocol):
    label: str

    async def start(self, registry: CollectorRegistry) -> None: ...

    async def infer(self, inputs: Tensors, timeout_s: float) -> Tensors: ...

    async def probe(self) -> tuple[str | None, list[TensorSpec] | None]: ...

    async def close(self) -> None: ...


class LocalCloud:
    """A model in this process, behind a batcher of its own."""

    def __init__(self, backend: InferenceBackend, batching: BatcherConfig, label: str) -> None:
        self.backend = backend
        self.batching = batching
        self.label = label
        self.batcher: DynamicBatcher | None = None

    async def start(self, registry: CollectorRegistry) -> None:
        self.batcher = DynamicBatcher(self.backend.run, self.batching, name=self.label)
        self.batcher.start()

    async def infer(self, inputs: Tensors, timeout_s: float) -> Tensors:
        assert self.batcher is not None, "start() first"
        try:
            return await asyncio.wait_for(self.batcher.submit(inputs, timeout_s), timeout_s)
        except QueueFull as err:
            raise CloudError(str(err), "rejected") from None
        except BatcherError as err:
            raise CloudError(str(err)) from None

    async def probe(self) -> tuple[str | None, list[TensorSpec] | None]:
        failure = self.batcher.failure if self.batcher is not None else None
        return failure, self.backend.outputs

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.close(drain=True)


def _spec_from_metadata(doc: dict[str, Any]) -> TensorSpec:
    shape = tuple(None if int(d) < 0 else int(d) for d in doc.get("shape", []))
    return TensorSpec(doc["name"], V2_TO_NP.get(doc.get("datatype", ""), "?"), shape)


class RemoteCloud:
    """A KServe v2 server: ``URL`` (the model served under the edge's name) or
    ``URL/v2/models/NAME``."""

    def __init__(self, url: str, default_name: str) -> None:
        base, _, name = url.rstrip("/").partition("/v2/models/")
        self.base = base
        self.name = name.split("/")[0] or default_name
        self.label = f"{self.base}/v2/models/{self.name}"
        self.client: httpx.AsyncClient | None = None

    def metadata(self, timeout_s: float = 3.0) -> tuple[str | None, list[TensorSpec] | None]:
        """(why it is unavailable, its outputs): read once at start-up, before the loop runs."""
        try:
            r = httpx.get(f"{self.base}/v2/models/{self.name}", timeout=timeout_s)
        except httpx.HTTPError as err:
            return f"cloud {self.label} unreachable ({type(err).__name__})", None
        return self._parse_metadata(r)

    def _parse_metadata(self, r: httpx.Response) -> tuple[str | None, list[TensorSpec] | None]:
        if r.status_code != 200:
            return f"cloud {self.label} answered {r.status_code} to a metadata request", None
        try:
            return None, [_spec_from_metadata(o) for o in r.json()["outputs"]]
        except (ValueError, KeyError, TypeError):
            return f"cloud {self.label} sent no KServe v2 model metadata", None

    async def start(self, registry: CollectorRegistry) -> None:
        self.client = httpx.AsyncClient(base_url=self.base, limits=httpx.Limits(max_connections=64))

    async def infer(self, inputs: Tensors, timeout_s: float) -> Tensors:
        assert self.client is not None, "start() first"
        body = {
            "inputs": [
                {"name": k, "datatype": NP_TO_V2[v.dtype.name], "shape": list(v.shape),
                 "data": v.ravel().tolist()}
                for k, v in inputs.items()
            ]
        }  # fmt: skip
        try:
            r = await self.client.post(
                f"/v2/models/{self.name}/infer",
                content=orjson.dumps(body),
                headers={"content-type": "application/json",
                         "X-Request-Timeout-Ms": str(int(timeout_s * 1000) or 1)},
                timeout=timeout_s,
            )  # fmt: skip
        except httpx.TimeoutException:
            raise TimeoutError(f"cloud {self.label} took over {timeout_s * 1000:g} ms") from None
        except httpx.HTTPError as err:
            raise CloudError(f"cloud {self.label}: {type(err).__name__}", "unavailable") from None
        if r.status_code != 200:
            kind = {503: "rejected", 504: "timeout"}.get(r.status_code, "error")
            raise CloudError(f"cloud {self.label} answered {r.status_code}: {r.text[:200]}", kind)
        return {
            o["name"]: np.asarray(o["data"], dtype=V2_TO_NP[o["datatype"]]).reshape(o["shape"])
            for o in orjson.loads(r.content)["outputs"]
        }

    async def probe(self) -> tuple[str | None, list[TensorSpec] | None]:
        assert self.client is not None, "start() first"
        try:
            r = await self.client.get(f"/v2/models/{self.name}", timeout=3.0)
        except httpx.HTTPError as err:
            return f"cloud {self.label} unreachable ({type(err).__name__})", None
        return self._parse_metadata(r)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()


# -- the cascade ----------------------------------------------------------------------------
_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, Any]] = (
    weakref.WeakKeyDictionary()
)


def _families(registry: CollectorRegistry) -> dict[str, Any]:
    """The cascade's metric families of one registry, created once (several cascades share)."""
    if registry not in _FAMILIES:
        r = registry
        _FAMILIES[registry] = {
            "rows": Counter("slimline_cascade_rows", "Rows answered, by route",
                            ["model", "route"], registry=r),
            "ratio": Gauge("slimline_cascade_escalation_ratio",
                           "Share of rows escalated to the cloud tier since start", ["model"],
                           registry=r),
            "tier": Histogram("slimline_cascade_tier_duration_seconds", "Latency of each tier",
                              ["model", "tier"], buckets=LATENCY_BUCKETS, registry=r),
            "failures": Counter("slimline_cascade_cloud_failures",
                                "Escalations answered by the edge because the cloud failed",
                                ["model", "kind"], registry=r),
            "degraded": Gauge("slimline_cascade_degraded", "1 while the cloud tier is unavailable",
                              ["model"], registry=r),
        }  # fmt: skip
    return _FAMILIES[registry]


class _Metrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        f = _families(registry)
        self.rows = {r: f["rows"].labels(model, r) for r in ROUTES}
        self.ratio = f["ratio"].labels(model)
        self.tier = {t: f["tier"].labels(model, t) for t in ("edge", "cloud")}
        self.failures = {k: f["failures"].labels(model, k) for k in FAILURES}
        self.degraded = f["degraded"].labels(model)
        self.total = 0
        self.escalated = 0

    def count(self, rows: int, escalated: int) -> None:
        self.total += rows
        self.escalated += escalated
        self.ratio.set(self.escalated / self.total if self.total else 0.0)


class Cascade:
    """The escalation logic of one served edge model (see the module's doc)."""

    def __init__(
        self,
        edge_outputs: list[TensorSpec],
        cloud: CloudTier,
        config: CascadeConfig,
        *,
        degraded: str | None = None,
    ) -> None:
        self.cloud = cloud
        self.config = config
        self.edge_outputs = edge_outputs
        self.output = config.output or edge_outputs[0].name
        if self.output not in {s.name for s in edge_outputs}:
            raise ServeError(
                f"cascade: the edge model has no output {self.output!r}; its outputs are "
                f"{', '.join(s.name for s in edge_outputs)}"
            )
        self.score: ScoreFn = resolve_score(config.score)
        self.degraded = degraded
        self.metrics: _Metrics | None = None
        self._probe: asyncio.Task[None] | None = None

    async def start(self, registry: CollectorRegistry, model: str) -> None:
        self.metrics = _Metrics(registry, model)
        self.metrics.degraded.set(1 if self.degraded else 0)
        await self.cloud.start(registry)
        self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        await self.cloud.close()

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            why, outputs = await self.cloud.probe()
            if why is None and outputs is not None:
                mismatch = check_outputs(self.edge_outputs, outputs)
                why = f"cascade: {mismatch} differ" if mismatch else None
            if why != self.degraded:
                log.warning("cascade cloud tier %s", f"degraded: {why}" if why else "available")
            self.degraded = why
            if self.metrics is not None:
                self.metrics.degraded.set(1 if why else 0)

    def observe_edge(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.tier["edge"].observe(seconds)

    async def refine(self, inputs: Tensors, outputs: Tensors) -> tuple[Tensors, dict[str, Any]]:
        """The edge ``outputs`` with the unsure rows replaced by the cloud's, and the response
        parameters that say which tier answered."""
        assert self.metrics is not None, "start() first"
        scores = np.asarray(self.score(outputs[self.output])).reshape(-1)
        low = np.flatnonzero(scores < self.config.threshold)
        rows = len(scores)
        if len(low) == 0:
            self.metrics.count(rows, 0)
            self.metrics.rows["edge"].inc(rows)
            return outputs, {"cascade_tier": "edge"}
        self.metrics.count(rows, len(low))
        self.metrics.rows["edge"].inc(rows - len(low))
        if self.degraded:
            return self._fallback(outputs, len(low), "unavailable", self.degraded)
        started = time.perf_counter()
        try:
            cloud = await self.cloud.infer(
                {k: v[low] for k, v in inputs.items()}, self.config.cloud_timeout_ms / 1000
            )
        except TimeoutError:
            why = f"cloud {self.cloud.label} took over {self.config.cloud_timeout_ms:g} ms"
            return self._fallback(outputs, len(low), "timeout", why)
        except CloudError as err:
            return self._fallback(outputs, len(low), err.kind, str(err))
        except Exception as err:  # a cloud tier's own bug must not fail the edge's answer
            log.exception("cascade cloud tier failed")
            return self._fallback(outputs, len(low), "error", f"{type(err).__name__}: {err}")
        self.metrics.tier["cloud"].observe(time.perf_counter() - started)
        merged = self._merge(outputs, cloud, low)
        if merged is None:
            why = f"cloud {self.cloud.label} answered outputs of other names or shapes"
            return self._fallback(outputs, len(low), "error", why)
        self.metrics.rows["cloud"].inc(len(low))
        tier = "cloud" if len(low) == rows else "edge+cloud"
        return merged, {"cascade_tier": tier, "cascade_escalated_rows": len(low)}

    def _merge(self, edge: Tensors, cloud: Tensors, low: np.ndarray) -> Tensors | None:
        merged = {}
        for name, arr in edge.items():
            part = cloud.get(name)
            if part is None or part.shape[1:] != arr.shape[1:] or len(part) != len(low):
                return None
            out = arr.copy()
            out[low] = part.astype(arr.dtype, copy=False)
            merged[name] = out
        return merged

    def _fallback(
        self, outputs: Tensors, escalated: int, kind: str, why: str
    ) -> tuple[Tensors, dict[str, Any]]:
        assert self.metrics is not None
        self.metrics.failures[kind].inc()
        self.metrics.rows["fallback"].inc(escalated)
        return outputs, {
            "cascade_tier": "edge",
            "cascade_fallback": kind,
            "cascade_fallback_reason": why,
            "cascade_escalated_rows": escalated,
        }


def attach_cascade(
    edge: ServedModel,
    cloud: str | Path,
    config: CascadeConfig,
    *,
    batching: BatcherConfig,
    load: Any,
) -> ServedModel:
    """Attach a cascade to ``edge``: ``cloud`` is a KServe v2 URL, a run directory or an ONNX
    file (loaded by ``load(path) -> ServedModel``). Outputs that differ are a one-line error;
    a URL that cannot be reached leaves the cascade degraded (served from the edge)."""
    degraded = None
    tier: CloudTier
    if str(cloud).startswith(("http://", "https://")):
        remote = RemoteCloud(str(cloud), edge.name)
        degraded, outputs = remote.metadata()
        tier = remote
        if degraded:
            log.warning("cascade starts degraded: %s; answering from the edge", degraded)
    else:
        model: ServedModel = load(Path(cloud))
        tier = LocalCloud(model.backend, batching, f"{model.name} (cloud)")
        outputs = model.backend.outputs
    if outputs is not None:
        mismatch = check_outputs(edge.backend.outputs, outputs)
        if mismatch:
            raise _mismatch_error(mismatch)
    edge.cascade = Cascade(edge.backend.outputs, tier, config, degraded=degraded)
    edge.meta["cascade"] = {"cloud": tier.label, **config.model_dump()}
    return edge
