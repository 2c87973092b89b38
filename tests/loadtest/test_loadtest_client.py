"""The load generator's HTTP client: deadlines per request on kept-alive connections."""

from __future__ import annotations

import asyncio
import time

from slimline.loadtest.client import HttpClient
from slimline.loadtest.payload import Payload

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"


async def _server(delays: list[float | None]) -> tuple[asyncio.Server, list[str]]:
    """Answers the i-th request after ``delays[i]`` seconds (None: never); logs closes."""
    events: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while delays:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            delay = delays.pop(0)
            if delay is None:
                events.append("close" if await reader.read() == b"" else "data")
                return
            await asyncio.sleep(delay)
            writer.write(OK)
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), events


def _url(server: asyncio.Server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_a_request_without_an_answer_times_out_and_its_connection_is_closed() -> None:
    async def scenario() -> tuple[str, float, str, list[str]]:
        server, events = await _server([None])
        client = HttpClient(_url(server), "m", timeout_s=0.3)
        t0 = time.perf_counter()
        outcome = await client.infer(Payload(b"{}"))
        took = time.perf_counter() - t0
        await asyncio.sleep(0.1)  # the server notices the close
        server.close()
        return outcome, took, client.error_samples["timeout"], events

    outcome, took, sample, events = asyncio.run(scenario())
    assert outcome == "timeout" and took >= 0.3
    assert sample == "no answer within 0.3 s" and events == ["close"]


def test_an_answered_request_leaves_no_deadline_behind_on_its_connection() -> None:
    # the second request runs past the first one's deadline on the same connection: a timer
    # left over from the first request would fail it
    async def scenario() -> list[str]:
        server, _ = await _server([0.0, 0.45])
        client = HttpClient(_url(server), "m", timeout_s=0.6)
        await client.connect(1)
        first = await client.infer(Payload(b"{}"))
        await asyncio.sleep(0.25)
        second = await client.infer(Payload(b"{}"))
        await client.aclose()
        server.close()
        return [first, second, str(len(client.error_samples))]

    assert asyncio.run(scenario()) == ["ok", "ok", "0"]
