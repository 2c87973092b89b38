"""One load test: typed settings, checks before the first request, the run, and its result."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
from pydantic import Field, model_validator

from ..errors import LoadTestError
from ..recipe import Config
from .client import HttpClient, split_url
from .generator import ClientFactory, ClosedPlan, OpenPlan, auto_processes, execute
from .payload import Encoding, Payload, build_payloads, load_samples
from .result import summarize
from .schedule import Arrival, Trace, arrival_schedule, load_trace, replay_schedule

log = logging.getLogger(__name__)

__all__ = [
    "PROCESS_RATE",
    "LoadTestConfig",
    "check_request",
    "check_server",
    "run_loadtest",
    "sample_payloads",
]

# Highest open-loop rate one generator process keeps on this class of machine with a lag p99
# under 1 ms (bench/loadtest_accuracy.py); above it the schedule is spread over processes.
PROCESS_RATE = 1000.0


class LoadTestConfig(Config):
    """Settings of one load test; exactly one of ``rate``, ``replay`` or ``concurrency``."""

    url: str
    model: str = Field(..., min_length=1)
    inputs: str | None = Field(None, description=".npz, task spec or run dir; default: model name")
    encoding: Encoding = "json"
    batch_size: int = Field(1, ge=1)
    arrival: Arrival = "poisson"
    rate: float | None = Field(None, gt=0)
    duration_s: float | None = Field(None, gt=0, description="default 10 s; replay: whole trace")
    warmup_s: float = Field(2.0, ge=0)
    seed: int = 0
    replay: str | None = None
    speed: float = Field(1.0, gt=0)
    concurrency: int | None = Field(None, ge=1)
    timeout_s: float = Field(30.0, gt=0)
    processes: int | Literal["auto"] = "auto"
    max_lag_ms: float = Field(10.0, gt=0)
    token: str | None = Field(None, exclude=True, repr=False)
    protocol: Literal["http", "grpc", "grpc-stream"] = "http"
    grpc_target: str | None = Field(
        None, description="host:port of the server's gRPC port (default: the URL's host, 8001)"
    )

    @model_validator(mode="after")
    def _one_load_shape(self) -> LoadTestConfig:
        given = [n for n in ("rate", "replay", "concurrency") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of --rate (open loop), --replay TRACE or --concurrency N "
                f"(closed loop); got {given or 'none'}"
            )
        split_url(self.url)
        return self

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    @property
    def grpc_address(self) -> str:
        """Where gRPC requests go: ``grpc_target``, else the URL's host at Triton's 8001."""
        if self.grpc_target:
            return self.grpc_target.removeprefix("grpc://")
        host = split_url(self.url)[1]
        return f"[{host}]:8001" if ":" in host else f"{host}:8001"


def check_server(url: str, model: str, token: str | None = None) -> dict[str, Any]:
    """The model's metadata, once the server is reachable and says it serves ``model``."""
    with _http(url, token) as http:
        try:
            live = http.get("/v2/health/live")
        except httpx.HTTPError as err:
            raise LoadTestError(
                f"cannot reach {url} ({type(err).__name__}: {err}); start the server "
                "(`slimline serve ...`) or fix the URL"
            ) from None
        _check_auth(live, url)
        if live.status_code != 200:
            raise LoadTestError(
                f"{url}/v2/health/live answered {live.status_code}; is it a KServe v2 server?"
            )
        meta = http.get(f"/v2/models/{model}")
        _check_auth(meta, url)
        if meta.status_code != 200:
            raise LoadTestError(
                f"the server at {url} has no model {model!r} (HTTP {meta.status_code}: "
                f"{_message(meta)}); pass --model with a name it serves{_known_models(http)}"
            )
        return dict(meta.json())


def check_request(
    url: str, model: str, payload: Payload, meta: dict[str, Any], token: str | None = None
) -> None:
    """The samples match the model's inputs, and one real request is answered 200."""
    _check_inputs(meta, payload, model)
    with _http(url, token) as http:
        answer = http.post(
            f"/v2/models/{model}/infer", content=payload.body, headers=payload.headers
        )
    if answer.status_code != 200:
        raise LoadTestError(
            f"a test request to model {model!r} failed with HTTP {answer.status_code}: "
            f"{_message(answer)}; check --inputs and --encoding"
        )


def _check_auth(resp: httpx.Response, url: str) -> None:
    if resp.status_code in (401, 403):
        raise LoadTestError(
            f"the server at {url} refused the request (HTTP {resp.status_code}: {_message(resp)}); "
            "put its API token in $SLIMLINE_API_TOKEN (or the variable named by --token-env)"
        )


def _http(url: str, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=10.0)


def sample_payloads(cfg: LoadTestConfig) -> list[Payload]:
    """Encoded requests from ``--inputs`` (default: the model name, read the same way)."""
    if cfg.inputs is not None:
        samples = load_samples(cfg.inputs)
    else:
        try:
            samples = load_samples(cfg.model)
        except LoadTestError as err:
            raise LoadTestError(
                f"no --inputs given, so the model name is the sample source: {err}; pass --inputs"
            ) from None
    if cfg.protocol != "http":
        from .grpc_client import grpc_payloads

        return grpc_payloads(samples, cfg.model, cfg.batch_size)
    return build_payloads(samples, cfg.encoding, cfg.batch_size)


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json().get("error", resp.text))[:300]
    except (json.JSONDecodeError, AttributeError):
        return resp.text[:300]


def _known_models(http: httpx.Client) -> str:
    try:
        index = http.post("/v2/repository/index", json={})
        names = [m["name"] for m in index.json()] if index.status_code == 200 else []
    except (httpx.HTTPError, json.JSONDecodeError, TypeError, KeyError):
        names = []
    return f" (it serves {', '.join(sorted(names))})" if names else ""


def _check_inputs(meta: dict[str, Any], payload: Payload, model: str) -> None:
    want = {t.get("name"): t.get("datatype") for t in meta.get("inputs", [])}
    head_len = payload.headers.get("Inference-Header-Content-Length")
    doc = json.loads(payload.body[: int(head_len)] if head_len else payload.body)
    got = {t["name"]: t["datatype"] for t in doc["inputs"]}
    if want and set(want) != set(got):
        raise LoadTestError(
            f"model {model!r} takes inputs {sorted(want)} but the samples have {sorted(got)}; "
            "pass --inputs with samples for this model"
        )
    wrong = [n for n in got if want.get(n) not in (None, got[n])]
    if wrong:
        n = wrong[0]
        raise LoadTestError(
            f"input {n!r} of model {model!r} is {want[n]}, the samples give {got[n]}"
        )


def _trace_payloads(trace: Trace, payloads: list[Payload]) -> tuple[np.ndarray, list[Payload]]:
    """Payload indices for a trace's rows; string references name JSON request files."""
    extra: dict[str, int] = {}
    ids = np.empty(len(trace.payloads), dtype=np.int64)
    for i, ref in enumerate(trace.payloads):
        if ref is None:
            ids[i] = i % len(payloads)
        elif isinstance(ref, int):
            ids[i] = ref % len(payloads)
        else:
            if ref not in extra:
                path = Path(trace.source).parent / ref
                if not path.is_file():
                    raise LoadTestError(
                        f"trace {trace.source} row {i + 1}: payload file {path} does not exist"
                    )
                extra[ref] = len(payloads) + len(extra)
            ids[i] = extra[ref]
    files = [
        Payload((Path(trace.source).parent / r).read_bytes(), {"Content-Type": "application/json"})
        for r in extra
    ]
    return ids, payloads + files


def plan_for(
    cfg: LoadTestConfig, payloads: list[Payload]
) -> tuple[OpenPlan | ClosedPlan, float, list[Payload]]:
    """The plan, its measured duration, and the payload list (a trace may add files)."""
    if cfg.concurrency is not None:
        duration = cfg.duration_s or 10.0
        return ClosedPlan(cfg.concurrency, cfg.warmup_s + duration), duration, payloads
    if cfg.replay is not None:
        trace = load_trace(Path(cfg.replay))
        total = None if cfg.duration_s is None else cfg.warmup_s + cfg.duration_s
        offsets = replay_schedule(trace, cfg.speed, total)
        ids, payloads = _trace_payloads(trace, payloads)
        span = float(offsets[-1]) if len(offsets) else 0.0
        duration = cfg.duration_s or max(span - cfg.warmup_s, 1e-3)
        if span <= cfg.warmup_s and cfg.duration_s is None:
            raise LoadTestError(
                f"trace lasts {span:.2f} s, not more than --warmup {cfg.warmup_s} s; lower --warmup"
            )
        return OpenPlan(offsets, ids[: len(offsets)]), duration, payloads
    assert cfg.rate is not None
    duration = cfg.duration_s or 10.0
    offsets = arrival_schedule(cfg.arrival, cfg.rate, cfg.warmup_s + duration, cfg.seed)
    return OpenPlan(offsets, np.arange(len(offsets)) % len(payloads)), duration, payloads


def _processes(cfg: LoadTestConfig, plan: OpenPlan | ClosedPlan, duration: float) -> int:
    if cfg.processes != "auto":
        return cfg.processes
    if isinstance(plan, ClosedPlan):
        return 1
    peak = len(plan.offsets) / max(cfg.warmup_s + duration, 1e-9)
    return auto_processes(peak, PROCESS_RATE)


def run_loadtest(
    cfg: LoadTestConfig,
    *,
    payloads: list[Payload] | None = None,
    client_factory: ClientFactory | None = None,
    stop: Any = None,
) -> dict[str, Any]:
    """Run the load test ``cfg`` describes and return its result dict.

    With the default HTTP client the server is checked first (reachable, serves the model,
    answers one request); every input problem raises :class:`LoadTestError` before the run.
    """
    meta = check_server(cfg.url, cfg.model, cfg.token) if client_factory is None else None
    if payloads is None:
        payloads = sample_payloads(cfg)
    plan, duration, payloads = plan_for(cfg, payloads)
    if client_factory is None:
        assert meta is not None
        client_factory = _checked_client(cfg, payloads[0], meta)
    processes = _processes(cfg, plan, duration)
    rate = cfg.rate or (
        len(plan.offsets) / (cfg.warmup_s + duration) if isinstance(plan, OpenPlan) else 1
    )
    connections = int(min(64, max(4, math.ceil(rate * 0.02))))

    def run_with(n: int) -> dict[str, Any]:
        rec = execute(client_factory, plan, payloads, n, stop, connections)
        config = cfg.model_dump(mode="json")
        config["processes"] = n
        return summarize(rec, mode=cfg.mode, warmup_s=cfg.warmup_s, duration_s=duration,
                         target_rate=cfg.rate, max_lag_ms=cfg.max_lag_ms, config=config)  # fmt: skip

    result = run_with(processes)
    more = min(os.cpu_count() or 1, 2 * processes)
    if cfg.processes == "auto" and _generator_bound(result) and more > processes:
        log.warning("the generator fell behind with %d process(es); running again with %d",
                    processes, more)  # fmt: skip
        result = run_with(more)
        result["config"]["escalated_from"] = processes
    return result


def _checked_client(cfg: LoadTestConfig, payload: Payload, meta: dict[str, Any]) -> ClientFactory:
    """The client of ``cfg.protocol``, once one real request through it was answered."""
    if cfg.protocol != "http":
        from .grpc_client import GrpcClient, check_grpc_request

        check_grpc_request(cfg.grpc_address, payload, cfg.model, cfg.token)
        stream = cfg.protocol == "grpc-stream"
        return functools.partial(
            GrpcClient, cfg.grpc_address, cfg.timeout_s, cfg.token, stream=stream
        )
    check_request(cfg.url, cfg.model, payload, meta, cfg.token)
    return functools.partial(HttpClient, cfg.url, cfg.model, cfg.timeout_s, cfg.token)


def _generator_bound(result: dict[str, Any]) -> bool:
    """Invalid because requests left late as a rule (lag p50 > 1 ms), not by a rare stall."""
    lag_p50 = result["schedule_lag_ms"]["p50"]
    return (
        not result["valid"] and result["mode"] == "open" and not result["partial"]
        and lag_p50 is not None and lag_p50 > 1.0
    )  # fmt: skip
