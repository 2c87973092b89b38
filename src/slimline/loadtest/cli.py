"""``slimline loadtest``, ``slimline capacity`` and ``slimline tune-serving``."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import LoadTestError
from .result import write_json

__all__ = ["register"]

TOKEN_ENV = "SLIMLINE_API_TOKEN"


def register(sub: Any) -> None:
    _register_loadtest(sub)
    _register_capacity(sub)
    _register_tune(sub)


def _register_loadtest(sub: Any) -> None:
    p = sub.add_parser(
        "loadtest",
        help="open-loop load test of a KServe v2 server (latency from scheduled send times)",
        description="Send requests at scheduled times (Poisson, constant or a replayed trace) "
        "whatever earlier ones did, or run closed loop with --concurrency; write a JSON result.",
    )
    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name on the server")
    p.add_argument("--inputs", help=".npz, task .py, example name or run dir (default: --model)")
    p.add_argument("--encoding", choices=["json", "binary"], default="json",
                   help="HTTP request encoding (gRPC always sends raw tensor bytes)")  # fmt: skip
    p.add_argument("--protocol", choices=["http", "grpc", "grpc-stream"], default="http",
                   help="send infer requests over HTTP, as gRPC ModelInfer calls, or on gRPC "
                   "ModelStreamInfer streams (one per connection); checks and /metrics still "
                   "use the HTTP URL")  # fmt: skip
    p.add_argument("--grpc-target", default=None,
                   help="HOST:PORT of the server's gRPC port (default: the URL's host, 8001)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=1, help="rows per request (default 1)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--rate", type=float, help="offered requests per second (open loop)")
    shape.add_argument("--replay", metavar="TRACE", help="JSONL/CSV trace of arrival times")
    shape.add_argument("--concurrency", type=int, help="closed loop with N users")
    p.add_argument(
        "--speed", type=float, default=1.0, help="replay speed factor (2 = twice as fast)"
    )
    p.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    p.add_argument(
        "--duration", type=float, help="measured seconds (default 10; replay: whole trace)"
    )
    p.add_argument("--warmup", type=float, default=2.0, help="seconds sent before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="client timeout per request (s)")
    p.add_argument("--processes", default="auto", help="generator processes: auto or N")
    p.add_argument(
        "--max-lag-ms",
        type=float,
        default=10.0,
        help="schedule lag p99 that (above 10%% of latency p99 too) invalidates a run",
    )
    p.add_argument("--out", type=Path, help="write the result JSON here")
    p.add_argument(
        "--token-env", default=TOKEN_ENV, help=f"env var with the API token (default {TOKEN_ENV})"
    )
    sw = p.add_argument_group("sweep (--sweep): raise the rate step by step and find the knee")
    sw.add_argument("--sweep", action="store_true", help="run a sweep instead of one load test")
    sw.add_argument("--slo-p99-ms", type=float, help="p99 SLO of the sweep (required with --sweep)")
    sw.add_argument("--rates", help="comma-separated rates, ascending (default: geometric steps)")
    sw.add_argument("--start-rate", type=float, default=10.0, help="first step (default 10)")
    sw.add_argument("--factor", type=float, default=1.5, help="growth per step (default 1.5)")
    sw.add_argument("--max-rate", type=float, default=100_000.0)
    sw.add_argument("--max-steps", type=int, default=15)
    sw.add_argument("--refine", type=int, default=2, help="bisection steps after the first failure")
    sw.add_argument("--max-error-rate", type=float, default=0.01)
    sw.add_argument(
        "--min-requests",
        type=int,
        default=200,
        help="a step lasts long enough for this many requests (up to 30 s)",
    )
    sw.add_argument("--no-scrape", action="store_true", help="do not read the server's /metrics")
    sw.add_argument("--no-html", action="store_true", help="no .html/.png next to --out")
    p.set_defaults(func=_loadtest_cmd)


def _register_capacity(sub: Any) -> None:
    p = sub.add_parser(
        "capacity",
        help="machines needed for a peak load, from a sweep; writes Prometheus alert rules",
        description="Per-machine capacity is the sweep's knee at the p99 SLO; machines = "
        "ceil(peak / (capacity x (1 - headroom))). Alert rules: warn from 70%% of capacity, "
        "act above 85%%.",
    )
    p.add_argument("result", type=Path, help="sweep (or load test) result JSON")
    p.add_argument("--peak-qps", type=float, required=True)
    p.add_argument("--slo-p99-ms", type=float, required=True)
    p.add_argument(
        "--headroom", type=float, default=0.40, help="share of capacity free at peak (0.3-0.5)"
    )
    p.add_argument("--model", help="model label for the rules (default: from the result)")
    p.add_argument(
        "--requests-metric",
        default="slimline_requests_total",
        help="the servers' request counter (labels: model, instance)",
    )
    p.add_argument("--out", type=Path, help="write the plan JSON here")
    p.add_argument("--rules", type=Path, help="write Prometheus alert rules (YAML) here")
    p.add_argument("--cloud-result", type=Path,
                   help="a cascade: the cloud model's own sweep; RESULT is the cascade's sweep. "
                   "Plans machines per tier for the escalated share of the peak")  # fmt: skip
    p.add_argument("--escalation-rate", type=float,
                   help="share of requests escalated (default: measured at the cascade's knee)")  # fmt: skip
    p.set_defaults(func=_capacity_cmd)


def _config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    processes: int | str = args.processes
    if processes != "auto":
        try:
            processes = int(processes)
        except ValueError:
            raise LoadTestError(
                f"--processes must be 'auto' or a number, not {processes!r}"
            ) from None
    return {
        "url": args.url,
        "model": args.model,
        "inputs": args.inputs,
        "encoding": args.encoding,
        "batch_size": args.batch_size,
        "arrival": args.arrival,
        "rate": args.rate,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "seed": args.seed,
        "replay": args.replay,
        "speed": args.speed,
        "concurrency": args.concurrency,
        "timeout_s": args.timeout,
        "processes": processes,
        "max_lag_ms": args.max_lag_ms,
        "token": os.environ.get(args.token_env) or None,
        "protocol": getattr(args, "protocol", "http"),
        "grpc_target": getattr(args, "grpc_target", None),
    }


def build_config(args: argparse.Namespace) -> Any:
    from .run import LoadTestConfig

    try:
        return LoadTestConfig(**_config_kwargs(args))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "settings"
        raise LoadTestError(f"load test {where}: {first['msg']}") from None


@contextlib.contextmanager
def ctrl_c_stops() -> Iterator[threading.Event]:
    """While active, Ctrl-C sets the yielded event instead of raising KeyboardInterrupt."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def print_summary(result: dict[str, Any]) -> None:
    lat, lag = result["latency_ms"], result["schedule_lag_ms"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    offered = result["offered_rate"]
    print(
        f"{result['mode']} loop: offered {'-' if offered is None else f'{offered:.1f}'} rps, "
        f"achieved {result['achieved_rate']:.1f} rps, {result['requests']} requests, "
        f"errors {result['error_rate']:.2%}"
    )
    print(
        f"latency ms: p50 {ms(lat['p50'])}  p95 {ms(lat['p95'])}  p99 {ms(lat['p99'])}  "
        f"p99.9 {ms(lat['p999'])}  max {ms(lat['max'])}   schedule lag p99 {ms(lag['p99'])}"
    )
    bad = {k: v for k, v in result["outcomes"].items() if k != "ok" and v}
    if bad:
        print("outcomes: " + ", ".join(f"{k} {v}" for k, v in bad.items()))
    cascade = cascade_line(result.get("server"))
    if cascade:
        print(cascade)


def _watch(cfg: Any, args: argparse.Namespace) -> Any:
    """The server's /metrics watched during a single load test (a cascade's escalation)."""
    if getattr(args, "no_scrape", False) or not getattr(cfg, "url", None):
        return None
    from .scrape import MetricsWatcher

    headers = {"Authorization": f"Bearer {cfg.token}"} if getattr(cfg, "token", None) else None
    return MetricsWatcher(cfg.url, cfg.model, headers).start()


def cascade_line(server: dict[str, Any] | None) -> str | None:
    """A cascade's figures under the load: escalation rate, fallbacks, per-tier latency."""
    if not server or "escalation_rate" not in server:
        return None
    tiers = "  ".join(
        f"{t} tier mean {server[f'{t}_tier_mean_ms']:.2f} ms"
        for t in ("edge", "cloud")
        if f"{t}_tier_mean_ms" in server
    )
    failures = ", ".join(f"{k} {v}" for k, v in server.get("cloud_failures", {}).items())
    return (
        f"cascade: escalation {server['escalation_rate']:.1%} of {server['cascade_rows']} rows, "
        f"{server['cloud_fallback_rows']} answered by the edge for a failed cloud"
        + (f" ({failures})" if failures else "")
        + (f"  {tiers}" if tiers else "")
    )


def _finish(result: dict[str, Any], out: Path | None) -> int:
    if out is not None:
        write_json(out, result)
        print(f"wrote {out}")
    if result.get("partial"):
        print('interrupted: the result is PARTIAL (marked "partial": true)', file=sys.stderr)
        return 130
    if not result.get("valid", True):
        raise LoadTestError(f"invalid run: {result['invalid_reason']}")
    return 0


def _quiet_http_logs() -> None:
    """httpx logs every request at INFO; the checks before a run are not news."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _loadtest_cmd(args: argparse.Namespace) -> int:
    from .run import run_loadtest

    _quiet_http_logs()
    if args.sweep:
        return _sweep_cmd(args)
    cfg = build_config(args)
    watcher = _watch(cfg, args)
    with ctrl_c_stops() as stop:
        result = run_loadtest(cfg, stop=stop)
    if watcher is not None:
        result["server"] = watcher.stop()
    print_summary(result)
    return _finish(result, args.out)


def _sweep_config(args: argparse.Namespace) -> Any:
    from .sweep import SweepConfig

    if args.slo_p99_ms is None:
        raise LoadTestError(
            "--sweep needs --slo-p99-ms, the p99 latency target that defines the knee"
        )
    try:
        rates = [float(r) for r in args.rates.split(",")] if args.rates else None
    except ValueError:
        raise LoadTestError(
            f"--rates must be numbers separated by commas, not {args.rates!r}"
        ) from None
    try:
        return SweepConfig(
            slo_p99_ms=args.slo_p99_ms,
            rates=rates,
            start_rate=args.start_rate,
            factor=args.factor,
            max_rate=args.max_rate,
            max_steps=args.max_steps,
            refine=args.refine,
            max_error_rate=args.max_error_rate,
        )
    except ValidationError as err:
        first = err.errors()[0]
        raise LoadTestError(
            f"sweep {'.'.join(map(str, first['loc'])) or 'settings'}: {first['msg']}"
        ) from None


def _sweep_cmd(args: argparse.Namespace) -> int:
    from .report import write_standalone
    from .run import check_request, check_server, sample_payloads
    from .sweep import http_step_runner, run_sweep

    if args.concurrency is not None or args.replay is not None:
        raise LoadTestError("--sweep raises an open-loop rate; drop --concurrency/--replay")
    sweep_cfg = _sweep_config(args)
    args.rate = sweep_cfg.rates[0] if sweep_cfg.rates else sweep_cfg.start_rate
    base = build_config(args)
    with ctrl_c_stops() as stop:
        meta = check_server(base.url, base.model, base.token)
        payloads = sample_payloads(base)
        check_request(base.url, base.model, payloads[0], meta, base.token)
        runner = http_step_runner(
            base,
            scrape=not args.no_scrape,
            stop=stop,
            payloads=payloads,
            min_requests=args.min_requests,
        )
        doc = run_sweep(sweep_cfg, runner, {"url": base.url, "model": base.model}, stop=stop)
    _print_sweep(doc)
    if args.out is not None:
        write_json(args.out, doc)
        print(f"wrote {args.out}")
        if not args.no_html:
            for path in write_standalone(doc, args.out):
                print(f"wrote {path}")
    if doc["partial"]:
        print("interrupted: the sweep is PARTIAL", file=sys.stderr)
        return 130
    return 0


def _print_sweep(doc: dict[str, Any]) -> None:
    for s in doc["steps"]:
        lat = s["latency_ms"]
        p99 = "-" if lat["p99"] is None else f"{lat['p99']:.2f}"
        print(
            f"  offered {s['offered_rate']:9.1f}  achieved {s['achieved_rate']:9.1f}  "
            f"p99 {p99:>8} ms  errors {s['error_rate']:6.2%}  {s['why']}"
        )
        cascade = cascade_line(s.get("server"))
        if cascade:
            print(f"    {cascade}")
    knee = doc["knee"]
    if knee:
        print(
            f"knee: {knee['offered_rate']:.1f} requests/s (p99 {knee['latency_ms']['p99']:.2f} ms "
            f"<= {doc['slo_p99_ms']:g} ms)"
        )
    else:
        print(f"no step met p99 <= {doc['slo_p99_ms']:g} ms")


def _capacity_cmd(args: argparse.Namespace) -> int:
    from .capacity import alert_rules, plan_capacity, write_rules
    from .result import read_result

    doc = read_result(args.result)
    plan = plan_capacity(doc, args.peak_qps, args.slo_p99_ms, args.headroom, str(args.result))
    if args.model:
        plan["model"] = args.model
    down = plan["load_at_peak_minus_one"]
    print(
        f"capacity {plan['capacity_per_machine']:.1f} requests/s per machine at p99 <= {args.slo_p99_ms:g} ms"
    )
    print(
        f"machines for {args.peak_qps:g} QPS with {args.headroom:.0%} headroom: {plan['machines']} "
        f"(each {plan['load_at_peak']:.0%} loaded at peak"
        + ("" if down is None else f", {down:.0%} with one machine down")
        + ")"
    )
    for note in plan["notes"]:
        print(f"note: {note}")
    if getattr(args, "cloud_result", None) is not None:
        from .capacity import plan_cloud_tier

        cloud = read_result(args.cloud_result)
        plan["cloud_tier"] = plan_cloud_tier(
            plan, doc, cloud, args.escalation_rate, str(args.cloud_result)
        )
        tier = plan["cloud_tier"]
        print(
            f"cloud tier: {tier['escalation_rate']:.1%} of {args.peak_qps:g} QPS = "
            f"{tier['peak_qps']:.1f} QPS at {tier['capacity_per_machine']:.1f} per machine: "
            f"{tier['machines']} machine(s); edge tier: {plan['machines']}"
        )
    if args.out is not None:
        write_json(args.out, plan)
        print(f"wrote {args.out}")
    if args.rules is not None:
        write_rules(args.rules, alert_rules(plan, args.requests_metric))
        print(f"wrote {args.rules}")
    return 0


def _register_tune(sub: Any) -> None:
    p = sub.add_parser(
        "tune-serving",
        help="pick the model variant and batcher settings with the most throughput within a p99 SLO",
        description="Serve each accepted candidate of a run with several batcher settings, sweep "
        "each for real, and write the configuration with the highest knee (coarse to fine, with "
        "early stops on dominated configurations).",
    )
    p.add_argument("run_dir", type=Path, help="run directory of `slimline optimize`")
    p.add_argument("--slo-p99-ms", type=float, required=True)
    p.add_argument("--variants", help="comma-separated candidate names (default: all accepted)")
    p.add_argument("--max-batch-sizes", default="1,4,8,16,32")
    p.add_argument("--queue-delays-ms", default="0.5,2,5")
    p.add_argument("--instances", default="1,2")
    p.add_argument("--no-spinning", action="store_true",
                   help="do not try ONNX Runtime spin-waiting (e.g. on cores shared with others)")  # fmt: skip
    p.add_argument("--start-rate", type=float, default=20.0)
    p.add_argument("--factor", type=float, default=1.4, help="sweep growth per step")
    p.add_argument("--step-duration", type=float, default=3.0, help="measured seconds per step")
    p.add_argument("--step-warmup", type=float, default=1.0)
    p.add_argument("--max-configs", type=int, default=24)
    p.add_argument("--tie-tolerance", type=float, default=0.05,
                   help="knees within this share of the best are a tie, won by the simplest "
                   "configuration (fewer instances, no spinning, smaller batch and delay)")  # fmt: skip
    p.add_argument("--encoding", choices=["json", "binary"], default="json")
    p.add_argument("--out", type=Path, help="default: RUN_DIR/tune-serving.json")
    p.set_defaults(func=_tune_cmd)


def _numbers(text: str, kind: type, flag: str) -> list[Any]:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LoadTestError(f"{flag} must be numbers separated by commas, not {text!r}") from None


def _tune_cmd(args: argparse.Namespace) -> int:
    from .tune import TuneConfig, tune_serving

    _quiet_http_logs()
    try:
        cfg = TuneConfig(
            slo_p99_ms=args.slo_p99_ms,
            variants=args.variants.split(",") if args.variants else None,
            max_batch_sizes=_numbers(args.max_batch_sizes, int, "--max-batch-sizes"),
            queue_delays_ms=_numbers(args.queue_delays_ms, float, "--queue-delays-ms"),
            instances=_numbers(args.instances, int, "--instances"),
            ort_spinning=[False] if args.no_spinning else [False, True],
            start_rate=args.start_rate,
            factor=args.factor,
            step_duration_s=args.step_duration,
            step_warmup_s=args.step_warmup,
            max_configs=args.max_configs,
            tie_tolerance=args.tie_tolerance,
            encoding=args.encoding,
        )
    except ValidationError as err:
        first = err.errors()[0]
        raise LoadTestError(
            f"tune-serving {'.'.join(map(str, first['loc']))}: {first['msg']}"
        ) from None
    with ctrl_c_stops() as stop:
        doc = tune_serving(args.run_dir, cfg, stop=stop)
    out = args.out or args.run_dir / "tune-serving.json"
    write_json(out, doc)
    for r in doc["configs"]:
        knee = "-" if r["knee_rate"] is None else f"{r['knee_rate']:.1f}"
        print(f"  {r['variant']:<16} {json.dumps(r['serve'])}  knee {knee} rps  {r['note']}")
    best = doc["best"]
    if best is None:
        print(doc["note"])
    else:
        gain = doc.get("gain_vs_default")
        print(
            f"best: {best['variant']} {json.dumps(best['serve'])}: {best['knee_rate']:.1f} rps per machine"
            + ("" if gain is None else f" ({gain:.2f}x the default settings)")
        )
        if "tie_note" in doc:
            print(f"  ({doc['tie_note']})")
        print(f"serve it with: {doc['serve_command']}")
        config_path = out.with_name("serve-config.json")
        write_json(config_path, {"command": doc["serve_command"], **best})
        print(f"wrote {out} and {config_path}")
    return 130 if doc["partial"] else 0
