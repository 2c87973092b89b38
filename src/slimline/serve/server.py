"""Running the app: in the foreground (the CLI), in a thread, or in a child process.

All three bind the socket first, so port 0 gives a free port and the URL is known before the
first request. SIGTERM (and Ctrl-C) make the foreground server refuse new connections and turn
``/v2/health/ready`` to 503 at once, answer every accepted request (uvicorn waits for open
requests; the lifespan shutdown drains each batcher's queue), then exit.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import uvicorn

from ..childproc import ChildOutput
from ..errors import ServeError
from .app import ServerState, ServeSettings, build_app
from .model import ServedModel
from .transport import http_protocol

__all__ = [
    "ServerHandle",
    "bind_socket",
    "run_in_subprocess",
    "run_in_thread",
    "serve_forever",
    "serve_in_thread",
]

log = logging.getLogger(__name__)
READY_LINE = "slimline serve: listening on "
TOKEN_ENV = "SLIMLINE_API_TOKEN"


class _Server(uvicorn.Server):
    """uvicorn's server, marking the app as draining the moment a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        state.on_fatal = self._fatal

    def _fatal(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.draining = True
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:  # a finished drain is a clean exit (status 0), not a kill
            self._captured_signals.remove(sig)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port} ({err.strerror}); choose another --port or --host"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _server(models: list[ServedModel], settings: ServeSettings) -> _Server:
    app = build_app(models, settings)
    config = uvicorn.Config(
        app,
        http=http_protocol(),  # a response leaves in one socket write
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        timeout_keep_alive=30,
    )
    return _Server(config, app.state.slimline)


def serve_forever(models: list[ServedModel], settings: ServeSettings) -> None:
    """Serve in the foreground until SIGTERM or SIGINT; prints the URL when listening."""
    sock = bind_socket(settings.host, settings.port)
    server = _server(models, settings)
    _freeze_start_up_objects()
    print(READY_LINE + _url(sock), flush=True)
    server.run(sockets=[sock])
    if server.state.warmup_error:
        raise ServeError(server.state.warmup_error)


def _freeze_start_up_objects() -> None:
    """Move every object alive now (modules, models, the app) out of the garbage collector's
    generations, as :func:`gc.freeze` is meant for. A full collection then walks only what was
    made since: under load, full collections of the whole heap cost about 30 ms of the event
    loop each, a fifth of its CPU per request (``bench/serve_cpu_per_request.py``). Cycles made
    after start-up are still collected; the frozen objects live as long as the process anyway.
    Only the foreground server does this: it owns its process."""
    gc.collect()
    gc.freeze()


@dataclass(frozen=True)
class ServerHandle:
    """A server running in a thread: its HTTP URL, its gRPC target (``host:port``, when
    ``grpc_port`` is set) and its state."""

    url: str
    grpc_target: str | None
    state: ServerState


@contextmanager
def run_in_thread(
    models: list[ServedModel], settings: ServeSettings | None = None, *, ready_timeout_s: float = 60
) -> Iterator[str]:
    """Serve from a background thread of this process; yields the base URL once ready."""
    with serve_in_thread(models, settings, ready_timeout_s=ready_timeout_s) as handle:
        yield handle.url


@contextmanager
def serve_in_thread(
    models: list[ServedModel], settings: ServeSettings | None = None, *, ready_timeout_s: float = 60
) -> Iterator[ServerHandle]:
    """:func:`run_in_thread`, yielding a :class:`ServerHandle` (the gRPC target too)."""
    settings = settings or ServeSettings(port=0)
    sock = bind_socket(settings.host, settings.port)
    server = _server(models, settings)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        _wait_ready(lambda: server.state.ready, lambda: not thread.is_alive(), ready_timeout_s,
                    server.state)  # fmt: skip
        front = server.state.grpc
        target = None if front is None else f"{settings.host}:{front.port}"
        yield ServerHandle(_url(sock), target, server.state)
    finally:
        server.should_exit = True
        thread.join(timeout=settings.drain_timeout_s + 5)
        sock.close()


def _wait_ready(ready: Any, dead: Any, timeout_s: float, state: ServerState | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if state is not None and state.problem:
            raise ServeError(state.problem)
        if dead():
            raise ServeError("the server stopped during start-up; see its log")
        if time.monotonic() > deadline:
            raise ServeError(f"the server was not ready within {timeout_s:.0f} s")
        time.sleep(0.02)


@contextmanager
def run_in_subprocess(
    paths: Sequence[str | Path], args: Sequence[str] = (), *, ready_timeout_s: float = 120,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[str]]]:  # fmt: skip
    """``python -m slimline.serve PATHS --port 0 ARGS`` in a child; yields (URL, process).

    The URL line and readiness are both awaited within ``ready_timeout_s``; the child's stdout
    is drained for its whole life, so it never blocks on a full pipe. On exit the child gets
    SIGTERM and is waited for (it drains first).
    """
    cmd = [sys.executable, "-m", "slimline.serve", *map(str, paths), "--port", "0", *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    output = ChildOutput(proc)
    started = time.monotonic()
    try:
        url = _read_url(proc, output, ready_timeout_s)
        token = _token_from(args) or (env or {}).get(TOKEN_ENV) or os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}

        def ready() -> bool:
            try:
                return httpx.get(url + "/v2/health/ready", headers=headers, timeout=2).is_success
            except httpx.HTTPError:
                return False

        left = ready_timeout_s - (time.monotonic() - started)
        _wait_ready(ready, lambda: proc.poll() is not None, max(left, 0.0))
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        output.close()
        if proc.stdout is not None:
            proc.stdout.close()


def _read_url(proc: subprocess.Popen[str], output: ChildOutput, timeout_s: float) -> str:
    try:
        return output.wait_for(READY_LINE, timeout_s)
    except EOFError:
        raise ServeError(
            f"the server exited with status {proc.wait()} before listening; see stderr"
        ) from None
    except TimeoutError:
        raise ServeError(
            f"the server printed no {READY_LINE!r} line within {timeout_s:g} s; see stderr"
        ) from None


def _token_from(args: Sequence[str]) -> str | None:
    args = list(args)
    if "--api-token-file" in args:
        return Path(args[args.index("--api-token-file") + 1]).read_text().strip()
    return None
