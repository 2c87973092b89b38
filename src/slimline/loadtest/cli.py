"""``slimline loadtest``, ``slimline capacity`` and ``slimline tune-serving``."""

from __future__ import annotations

import argparse
import contextlib
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
    p.add_argument("--encoding", choices=["json", "binary"], default="json")
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
        "--max-lag-ms", type=float, default=10.0, help="schedule lag p99 that invalidates a run"
    )
    p.add_argument("--out", type=Path, help="write the result JSON here")
    p.add_argument(
        "--token-env", default=TOKEN_ENV, help=f"env var with the API token (default {TOKEN_ENV})"
    )
    p.set_defaults(func=_loadtest_cmd)


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


def _loadtest_cmd(args: argparse.Namespace) -> int:
    from .run import run_loadtest

    cfg = build_config(args)
    with ctrl_c_stops() as stop:
        result = run_loadtest(cfg, stop=stop)
    print_summary(result)
    return _finish(result, args.out)
