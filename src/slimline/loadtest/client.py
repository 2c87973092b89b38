"""The load generator's client: one small interface, an HTTP implementation, and a fake.

:class:`Client` is what the scheduler talks to: ``await client.infer(payload)`` returns an
outcome (``ok``, ``rejected``, ``timeout``, ``bad_request``, ``connection``, ``server_error``).

:class:`HttpClient` is a lean HTTP/1.1 keep-alive client on asyncio transports, with responses
parsed by ``httptools`` (llhttp). Request bytes are built once per payload, so a request costs one
socket write and one parse: measured against aiohttp it adds less client time per request, which is
what keeps the schedule lag and the latency error small (``bench/loadtest_accuracy.py``).

:class:`FakeClient` answers after a configurable delay without any network, so the scheduler,
the windows and the statistics can be tested alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

import httptools

from ..errors import LoadTestError
from .payload import Payload

__all__ = ["OUTCOMES", "Client", "FakeClient", "HttpClient", "outcome_of_status", "split_url"]

OUTCOMES: tuple[str, ...] = (
    "ok",
    "rejected",
    "timeout",
    "bad_request",
    "connection",
    "server_error",
)


def outcome_of_status(status: int) -> str:
    if 200 <= status < 300:
        return "ok"
    if status in (429, 503):
        return "rejected"
    if status in (408, 504):
        return "timeout"
    if 400 <= status < 500:
        return "bad_request"
    return "server_error"


class Client(Protocol):
    """Sends one inference request and says how it ended."""

    async def infer(self, payload: Payload) -> str: ...

    async def aclose(self) -> None: ...


def split_url(url: str) -> tuple[str, str, int, str]:
    """``(scheme, host, port, base_path)`` of an ``http(s)://host[:port][/base]`` URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadTestError(f"URL {url!r} must look like http://127.0.0.1:8000")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname, port, parts.path.rstrip("/")


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.body = bytearray()
        self.reusable = True
        self.loop = asyncio.get_running_loop()  # made by the loop's create_connection
        self.timer: asyncio.TimerHandle | None = None  # the deadline of the request in flight

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(ConnectionError(f"bad HTTP response: {err}"))

    def on_body(self, body: bytes) -> None:
        if len(self.body) < 4096:  # kept only to quote error messages
            self.body += body

    def on_message_complete(self) -> None:
        self.reusable = self.parser.should_keep_alive()
        if self.timer is not None:
            self.timer.cancel()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), bytes(self.body)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._fail(ConnectionError(f"connection closed: {exc}" if exc else "connection closed"))

    def _fail(self, err: Exception) -> None:
        self.reusable = False
        if self.timer is not None:
            self.timer.cancel()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(err)
        if self.transport is not None:
            self.transport.close()

    def send(self, request: bytes, deadline: float) -> asyncio.Future[tuple[int, bytes]]:
        """The answer's future; it fails with TimeoutError at ``deadline`` (loop time)."""
        assert self.transport is not None and (self.waiter is None or self.waiter.done())
        self.waiter = self.loop.create_future()
        self.timer = self.loop.call_at(deadline, self._time_out)
        self.body.clear()
        self.transport.write(request)
        return self.waiter

    def _time_out(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(TimeoutError())

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()


class HttpClient:
    """KServe v2 ``infer`` over HTTP/1.1 keep-alive connections, one request per connection."""

    def __init__(self, url: str, model: str, timeout_s: float = 30.0, token: str | None = None):
        self.scheme, self.host, self.port, base = split_url(url)
        self.path = f"{base}/v2/models/{model}/infer"
        self.timeout_s = timeout_s
        self.auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self.ssl = ssl.create_default_context() if self.scheme == "https" else None
        self.idle: list[_Connection] = []
        self.requests: dict[int, bytes] = {}
        self.error_samples: dict[str, str] = {}

    def _request(self, payload: Payload) -> bytes:
        raw = self.requests.get(id(payload))
        if raw is None:
            extra = "".join(f"{k}: {v}\r\n" for k, v in payload.headers.items())
            head = (
                f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self.auth}"
                f"{extra}Content-Length: {len(payload.body)}\r\n\r\n"
            )
            raw = self.requests[id(payload)] = head.encode("latin-1") + payload.body
        return raw

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl)
        return conn

    async def connect(self, n: int) -> None:
        """Open ``n`` idle connections ahead of the run, so early requests do not pay for it."""
        self.idle.extend(await asyncio.gather(*(self._connect() for _ in range(n))))

    def _idle(self) -> _Connection | None:
        """A kept-alive connection the server has not closed meanwhile, if any."""
        while self.idle:
            conn = self.idle.pop()
            if conn.reusable and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def infer(self, payload: Payload) -> str:
        request = self._request(payload)
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        conn = self._idle()
        try:
            if conn is None:
                async with asyncio.timeout_at(deadline):
                    conn = await self._connect()
            # a timer on the answer's future, not asyncio.timeout: a few µs less per request
            status, body = await conn.send(request, deadline)
        except TimeoutError:
            if conn is not None:
                conn.close()
            self.error_samples.setdefault("timeout", f"no answer within {self.timeout_s} s")
            return "timeout"
        except (OSError, ConnectionError) as err:
            if conn is not None:
                conn.close()
            self.error_samples.setdefault("connection", str(err))
            return "connection"
        if conn.reusable:
            self.idle.append(conn)
        else:
            conn.close()
        outcome = outcome_of_status(status)
        if outcome != "ok":
            self.error_samples.setdefault(
                outcome, f"HTTP {status}: {body[:300].decode(errors='replace')}"
            )
        return outcome

    async def aclose(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()
        await asyncio.sleep(0)


class FakeClient:
    """Answers after ``latency(i)`` seconds with ``outcome(i)`` for the ``i``-th request.

    With ``serial=True`` requests are served one at a time in arrival order, like a server with
    a single worker: a slow request then delays every request queued behind it.
    """

    def __init__(
        self,
        latency: float | Callable[[int], float] = 0.0,
        outcome: str | Callable[[int], str] = "ok",
        serial: bool = False,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.latency = latency if callable(latency) else (lambda _i, s=latency: s)
        self.outcome = outcome if callable(outcome) else (lambda _i, o=outcome: o)
        self.lock = asyncio.Lock() if serial else None
        self.sleep = sleep
        self.calls = 0
        self.error_samples: dict[str, str] = {}

    async def _serve(self, i: int) -> str:
        await self.sleep(self.latency(i))
        return self.outcome(i)

    async def infer(self, payload: Payload) -> str:
        i = self.calls
        self.calls += 1
        if self.lock is None:
            return await self._serve(i)
        async with self.lock:
            return await self._serve(i)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.sleep(0)
