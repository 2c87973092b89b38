"""``tune-serving``: the model variant and batcher settings with the most throughput within a p99 SLO.

Every configuration is measured for real: a server is started for it (``slimline serve`` in a
child process) and swept (:mod:`slimline.loadtest.sweep`); its score is the sweep's knee, the
requests per second one machine serves within the SLO.

The search is coarse to fine and stops early on dominated configurations:

1. *variants*: each accepted ONNX candidate of the run with the default batcher settings;
2. *batch size*: ``max_batch_size`` over its grid, for the variants still in the race;
3. *delay and instances*: ``max_queue_delay_ms`` and ``instances`` (threads = cores / instances)
   around the best batch size (at a best batch size of 1 the delay has no effect and is kept).

A configuration is out of the race when its knee is below ``dominated_ratio`` x the best knee so
far, and each sweep starts at ``dominated_ratio`` x that best knee: a configuration that fails its
first step is dominated and costs one step.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from ..errors import LoadTestError
from ..recipe import Config
from .payload import Encoding, Payload, build_payloads, load_samples
from .result import SCHEMA
from .run import LoadTestConfig
from .sweep import SweepConfig, http_step_runner, run_sweep

__all__ = ["ServeSetting", "TuneConfig", "run_variants", "tune_serving"]

log = logging.getLogger(__name__)


class ServeSetting(Config):
    """The batcher settings of one configuration (the `slimline serve` flags)."""

    max_batch_size: int = Field(8, ge=1)
    max_queue_delay_ms: float = Field(2.0, ge=0)
    instances: int = Field(1, ge=1)
    threads: int | None = Field(None, ge=1, description="default: cores / instances")
    ort_spinning: bool = Field(False, description="idle ONNX Runtime threads spin-wait")
    runtime: Literal["onnxruntime", "openvino"] | None = Field(
        None, description="the runtime to serve on; default: ONNX Runtime"
    )

    def args(self) -> list[str]:
        threads = self.threads or max(1, (os.cpu_count() or 1) // self.instances)
        return [
            "--max-batch-size", str(self.max_batch_size),
            "--max-queue-delay-ms", f"{self.max_queue_delay_ms:g}",
            "--instances", str(self.instances),
            "--threads", str(threads),
        ] + (["--ort-spinning"] if self.ort_spinning else []) + (
            ["--runtime", self.runtime] if self.runtime else []
        )  # fmt: skip


class TuneConfig(Config):
    slo_p99_ms: float = Field(..., gt=0)
    variants: list[str] | None = Field(None, description="candidate names; default: all accepted")
    max_batch_sizes: list[int] = Field(default_factory=lambda: [1, 4, 8, 16, 32])
    queue_delays_ms: list[float] = Field(default_factory=lambda: [0.5, 2.0, 5.0])
    instances: list[int] = Field(default_factory=lambda: [1, 2])
    ort_spinning: list[bool] = Field(
        default_factory=lambda: [False, True],
        description="spin-wait settings tried with each variant in the first stage: spinning "
        "threads answer a many-op model (a transformer) sooner, at the price of burnt CPU",
    )
    start_rate: float = Field(20.0, gt=0)
    factor: float = Field(1.4, gt=1)
    refine: int = Field(1, ge=0)
    max_steps: int = Field(12, ge=1, description="steps per sweep")
    min_requests: int = Field(200, ge=1, description="requests per sweep step, at least")
    step_duration_s: float = Field(3.0, gt=0)
    step_warmup_s: float = Field(1.0, ge=0)
    dominated_ratio: float = Field(0.7, gt=0, lt=1)
    max_configs: int = Field(24, ge=1)
    tie_tolerance: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="knees within this share of the best one are a tie, and the tie goes to "
        "the simplest configuration: fewer instances (memory), no spinning (CPU), smaller "
        "batches and delays (latency). Repeated sweeps of one configuration differ by more "
        "than this on a shared machine",
    )
    encoding: Encoding = "json"
    max_lag_ms: float = Field(10.0, gt=0)


def run_variants(run_dir: Path, names: list[str] | None) -> dict[str, Path]:
    """Accepted candidates of a run that have an ONNX artifact, by name."""
    manifest = run_dir / "manifest.json"
    if not manifest.is_file():
        raise LoadTestError(
            f"{run_dir} has no manifest.json; pass a run directory of `slimline optimize`"
        )
    doc = json.loads(manifest.read_text())
    found = {
        c["name"]: run_dir / c["artifact"]
        for c in doc.get("candidates", [])
        if c.get("artifact") and (c.get("accepted") or c["name"] == "fp32-onnx")
    }
    if names:
        missing = sorted(set(names) - set(found))
        if missing:
            raise LoadTestError(
                f"run {run_dir} has no accepted ONNX candidate {missing[0]!r}; it has {sorted(found)}"
            )
        found = {n: found[n] for n in names}
    if not found:
        raise LoadTestError(
            f"run {run_dir} has no accepted candidate with an ONNX artifact to serve"
        )
    for name, path in found.items():
        if not path.is_file():
            raise LoadTestError(f"run {run_dir}: artifact {path} of {name!r} is missing")
    return found


# (onnx path, serve args) -> context manager yielding the server's base URL
ServerStarter = Callable[[Path, list[str]], AbstractContextManager[str]]


def subprocess_server(path: Path, args: list[str]) -> AbstractContextManager[str]:
    from contextlib import contextmanager

    from ..serve import run_in_subprocess

    @contextmanager
    def cm() -> Iterator[str]:
        with run_in_subprocess([path], args) as (url, _proc):
            yield url

    return cm()


class _Search:
    def __init__(
        self,
        cfg: TuneConfig,
        variants: dict[str, Path],
        payloads: list[Payload],
        start_server: ServerStarter,
        stop: Any,
    ):
        self.cfg, self.variants, self.payloads = cfg, variants, payloads
        self.start_server, self.stop = start_server, stop
        self.results: list[dict[str, Any]] = []

    def best(self, variant: str | None = None) -> dict[str, Any] | None:
        pool = [
            r
            for r in self.results
            if r["knee_rate"] and (variant is None or r["variant"] == variant)
        ]
        return max(pool, key=lambda r: r["knee_rate"]) if pool else None

    def pick(self) -> dict[str, Any] | None:
        """The configuration to recommend: the simplest one whose knee is within
        ``tie_tolerance`` of the best knee (a faster knee by less than that is noise)."""
        best = self.best()
        if best is None:
            return None
        floor = (1 - self.cfg.tie_tolerance) * best["knee_rate"]
        ties = [r for r in self.results if r["knee_rate"] and r["knee_rate"] >= floor]
        return min(ties, key=_simplicity)

    def seen(self, variant: str, setting: ServeSetting) -> bool:
        return any(
            r["variant"] == variant and r["serve"] == setting.model_dump() for r in self.results
        )

    def measure(self, variant: str, setting: ServeSetting, stage: str) -> dict[str, Any] | None:
        if self.seen(variant, setting) or len(self.results) >= self.cfg.max_configs:
            return None
        if self.stop is not None and self.stop.is_set():
            return None
        best = self.best()
        start = (
            max(self.cfg.start_rate, self.cfg.dominated_ratio * best["knee_rate"])
            if best
            else self.cfg.start_rate
        )
        path = self.variants[variant]
        with self.start_server(path, setting.args()) as url:
            sweep = self._sweep(url, path.stem, start)
        knee = sweep["knee"]
        entry = {
            "variant": variant,
            "artifact": str(path),
            "serve": setting.model_dump(),
            "stage": stage,
            "knee_rate": knee["achieved_rate"] if knee else None,
            "p99_at_knee_ms": knee["latency_ms"]["p99"] if knee else None,
            "sweep_start_rate": start,
            "note": ""
            if knee
            else f"failed its first step at {start:.3g} rps" + (": dominated" if best else ""),
            "sweep": sweep,
        }
        self.results.append(entry)
        log.info("%s %s: knee %s rps", variant, setting.model_dump(), entry["knee_rate"])
        return entry

    def _sweep(self, url: str, model: str, start: float) -> dict[str, Any]:
        c = self.cfg
        base = LoadTestConfig(
            url=url,
            model=model,
            rate=start,
            duration_s=c.step_duration_s,
            warmup_s=c.step_warmup_s,
            encoding=c.encoding,
            max_lag_ms=c.max_lag_ms,
        )
        sweep_cfg = SweepConfig(
            slo_p99_ms=c.slo_p99_ms,
            start_rate=start,
            factor=c.factor,
            refine=c.refine,
            max_steps=c.max_steps,
            pause_s=0.3,
        )
        runner = http_step_runner(
            base, scrape=True, stop=self.stop, payloads=self.payloads, min_requests=c.min_requests
        )
        return run_sweep(sweep_cfg, runner, {"url": url, "model": model}, stop=self.stop)

    def alive(self, variants: list[str]) -> list[str]:
        """Variants still in the race: a knee within ``dominated_ratio`` of the best one.

        None when no configuration met the SLO at all: finer settings cannot rescue a search
        whose every variant failed its first step (lower ``start_rate`` instead).
        """
        best = self.best()
        if best is None:
            return []
        floor = self.cfg.dominated_ratio * best["knee_rate"]
        return [v for v in variants if (b := self.best(v)) is not None and b["knee_rate"] >= floor]


def tune_serving(
    run_dir: Path,
    cfg: TuneConfig,
    *,
    start_server: ServerStarter = subprocess_server,
    stop: Any = None,
) -> dict[str, Any]:
    """Search variants x batcher settings; returns the tune-serving result."""
    variants = run_variants(run_dir, cfg.variants)
    payloads = build_payloads(load_samples(str(run_dir)), cfg.encoding)
    search = _Search(cfg, variants, payloads, start_server, stop)
    # the runtime the run picked (runtime auto or openvino); ONNX Runtime when it names none
    picked = json.loads((run_dir / "manifest.json").read_text()).get("selected_runtime")
    default = ServeSetting(runtime=picked if picked == "openvino" else None)
    for v in variants:  # stage 1: variants at the default settings, with and without spinning
        for spin in dict.fromkeys([False, *cfg.ort_spinning]):
            search.measure(v, default.model_copy(update={"ort_spinning": spin}), "variants")
    for v in search.alive(list(variants)):  # stage 2: batch size, at the variant's best so far
        base = _best_setting(search, v)
        for mbs in cfg.max_batch_sizes:
            search.measure(v, base.model_copy(update={"max_batch_size": mbs}), "batch size")
    for v in search.alive(list(variants)):  # stage 3: delay and instances around the best batch
        base = _best_setting(search, v)
        # a batch of one is full on arrival and leaves at once: the queue delay cannot matter,
        # so trying its values would only measure noise (and pick by it)
        delays = cfg.queue_delays_ms if base.max_batch_size > 1 else [base.max_queue_delay_ms]
        for delay in delays:
            for inst in cfg.instances:
                update = {"max_queue_delay_ms": delay, "instances": inst, "threads": None}
                search.measure(v, base.model_copy(update=update), "delay and instances")
    return _result(run_dir, cfg, search, default)


def _simplicity(r: dict[str, Any]) -> tuple[Any, ...]:
    s = r["serve"]
    return (
        s["instances"],
        s["ort_spinning"],
        s["max_batch_size"],
        s["max_queue_delay_ms"],
        -r["knee_rate"],
    )


def _best_setting(search: _Search, variant: str) -> ServeSetting:
    best = search.best(variant)
    assert best is not None, "only variants in the race are refined"
    return ServeSetting(**best["serve"])


def _selected(run_dir: Path) -> str | None:
    try:
        return str(json.loads((run_dir / "manifest.json").read_text()).get("selected"))
    except (OSError, ValueError):
        return None


def _result(
    run_dir: Path, cfg: TuneConfig, search: _Search, default: ServeSetting
) -> dict[str, Any]:
    fastest, best = search.best(), search.pick()
    selected = _selected(run_dir)
    baseline_variant = selected if selected in search.variants else next(iter(search.variants))
    base = next(
        (
            r
            for r in search.results
            if r["variant"] == baseline_variant and r["serve"] == default.model_dump()
        ),
        None,
    )
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "kind": "tune-serving",
        "run_dir": str(run_dir),
        "slo_p99_ms": cfg.slo_p99_ms,
        "config": cfg.model_dump(mode="json"),
        "configs": search.results,
        "partial": bool(search.stop is not None and search.stop.is_set()),
        "default": None if base is None else _brief(base),
        "best": None if best is None else _brief(best),
        "fastest": None if fastest is None else _brief(fastest),
    }
    if best is None:
        doc["note"] = (
            f"no configuration met p99 <= {cfg.slo_p99_ms:g} ms at {cfg.start_rate:g} requests/s; "
            "lower --start-rate, loosen the SLO, or use a faster machine"
        )
    else:
        doc["serve_command"] = serve_command(run_dir, best, selected)
        if fastest is not None and fastest is not best:
            doc["tie_note"] = (
                f"picked over the fastest configuration ({fastest['knee_rate']:.4g} rps, "
                f"{best['knee_rate'] / fastest['knee_rate']:.1%} of it): within the tie "
                f"tolerance of {cfg.tie_tolerance:.0%}, and simpler"
            )
        if base is not None and base["knee_rate"]:
            doc["gain_vs_default"] = best["knee_rate"] / base["knee_rate"]
    return doc


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r[k] for k in ("variant", "artifact", "serve", "knee_rate", "p99_at_knee_ms")}


def serve_command(run_dir: Path, best: dict[str, Any], selected: str | None) -> str:
    target = str(run_dir) if best["variant"] == selected else best["artifact"]
    args = ServeSetting(**best["serve"]).args()
    return shlex.join(["slimline", "serve", target, *args])
