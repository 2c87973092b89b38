"""What one gRPC unary call costs before any model work: server designs side by side.

    flock /tmp/slimline-timing.lock .venv/bin/python bench/serve_grpc_floor.py [--seconds 3]

Each design serves ``ModelInfer`` in its own child process with a handler that does nothing but
visit an asyncio event loop once (a future resolved on the next turn, as slimline's batcher
answers a request) and return a fixed answer, raw bytes in and out:

- ``aio``: a ``grpc.aio`` server on a uvloop event loop (what ``slimline serve`` runs);
- ``aio-thread``: a ``grpc.aio`` server on its own thread and loop, each call handed to the
  main loop and back;
- ``sync``: ``grpc.server`` with a 16-thread pool, each call handed to the loop and back.

Closed loop of 8 callers on one ``grpc.aio`` channel (no retries, no BDP pings, as the load
generator's), in rotating order per round; per design the median over the rounds of calls/s and
CPU µs per call of the server process and of this process. Measurement only, no results file:
``bench/RESULTS-serve.md`` quotes a run in its prose.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import psutil
import uvloop

SERVICE, METHOD = "inference.GRPCInferenceService", "ModelInfer"
ANSWER = b"\x0a\x05mnist" + bytes(60)  # a ModelInferResponse-sized answer
OPTIONS = [("grpc.so_reuseport", 0)]
DESIGNS = ("aio", "aio-thread", "sync")


async def visit() -> bytes:
    """One turn of the event loop, as a request answered by the batcher costs it."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[bytes] = loop.create_future()
    loop.call_soon(fut.set_result, ANSWER)
    return await fut


def _handlers(fn: Any) -> tuple[grpc.GenericRpcHandler, ...]:
    handler = grpc.unary_unary_rpc_method_handler(fn)  # no (de)serializers: bytes in and out
    return (grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),)


async def _aio_server(port: int, handler: Any) -> None:
    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers(_handlers(handler))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("READY", flush=True)
    await server.wait_for_termination()


def serve(design: str, port: int) -> None:
    """Serve one design until killed."""
    if design == "aio":

        async def on_loop(request: bytes, context: Any) -> bytes:
            return await visit()

        uvloop.run(_aio_server(port, on_loop))
        return
    loop = uvloop.new_event_loop()  # the "main" loop that the batcher would run on
    if design == "sync":

        def in_pool(request: bytes, context: Any) -> bytes:
            return asyncio.run_coroutine_threadsafe(visit(), loop).result()

        server = grpc.server(ThreadPoolExecutor(16), options=OPTIONS)
        server.add_generic_rpc_handlers(_handlers(in_pool))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("READY", flush=True)
    else:

        async def handed_over(request: bytes, context: Any) -> bytes:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(visit(), loop))

        threading.Thread(target=uvloop.run, args=(_aio_server(port, handed_over),),
                         daemon=True).start()  # fmt: skip
    loop.run_forever()


async def _calls(port: int, seconds: float, users: int = 8) -> int:
    options = [("grpc.enable_retries", 0), ("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        call = channel.unary_unary(f"/{SERVICE}/{METHOD}")
        await channel.channel_ready()
        done, end = 0, time.monotonic() + seconds

        async def user() -> None:
            nonlocal done
            while time.monotonic() < end:
                await call(b"\x0a\x05mnist", timeout=10)
                done += 1

        await asyncio.gather(*(user() for _ in range(users)))
    return done


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(designs: list[str], seconds: float, rounds: int) -> dict[str, list[float]]:
    """Per design: median [calls/s, server µs per call, client µs per call] over the rounds."""
    children: dict[str, tuple[subprocess.Popen[str], int]] = {}
    try:
        for design in designs:
            port = _free_port()
            cmd = [sys.executable, __file__, "--serve", design, "--port", str(port)]
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            assert child.stdout is not None and child.stdout.readline().startswith("READY")
            children[design] = (child, port)
        got: dict[str, list[tuple[float, float, float]]] = {d: [] for d in designs}
        for r in range(rounds):
            for design in designs[r % len(designs) :] + designs[: r % len(designs)]:
                child, port = children[design]
                server = psutil.Process(child.pid)
                cpu0, own0 = sum(server.cpu_times()[:2]), time.process_time()
                n = max(uvloop.run(_calls(port, seconds)), 1)
                server_us = 1e6 * (sum(server.cpu_times()[:2]) - cpu0) / n
                got[design].append((n / seconds, server_us, 1e6 * (time.process_time() - own0) / n))
        return {d: [statistics.median(g[i] for g in v) for i in range(3)] for d, v in got.items()}
    finally:
        for child, _ in children.values():
            child.kill()
            child.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--designs", default=",".join(DESIGNS))
    ap.add_argument("--serve", choices=DESIGNS, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    before = os.getloadavg()[0]
    result = measure(args.designs.split(","), args.seconds, args.rounds)
    print("| design | calls/s | server CPU µs per call | client CPU µs per call |")
    print("|---|---|---|---|")
    for design, (rate, server_us, client_us) in result.items():
        print(f"| {design} | {rate:.0f} | {server_us:.0f} | {client_us:.0f} |")
    print(f"load average (1 min) {before:.1f} before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
