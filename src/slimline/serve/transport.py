"""One socket write per response: uvicorn's HTTP protocol over a transport that coalesces writes.

uvicorn writes a response's status line and headers when the app sends ``http.response.start``
and the body when it sends ``http.response.body``; on uvloop each ``write`` is a ``send``
system call at once, so every small response costs two system calls and two TCP segments, and
the client wakes up for each. :class:`CoalescingTransport` holds the writes made during one turn
of the event loop and hands them to the socket together at the end of that turn (a
``call_soon``), so a response whose two messages are sent back to back, as the infer route
sends them, leaves in one write. The bytes on the wire are the same; nothing waits on a timer.

:func:`http_protocol` gives uvicorn (its ``http`` setting) the httptools protocol with this
transport, or ``"auto"`` when httptools is not installed.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

__all__ = ["CoalescingTransport", "http_protocol"]


class CoalescingTransport:
    """Wraps an asyncio transport; ``write`` is deferred to the end of the loop's turn, every
    other method goes to the wrapped transport (``close`` after sending what is held)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        """Send what is held now (also run by the loop at the end of the turn)."""
        if not self._held:
            return
        data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
        self._held = []
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def http_protocol() -> Any:
    """uvicorn's ``http`` setting: httptools over :class:`CoalescingTransport`, else auto."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools ships with uvicorn[standard]; without it, uvicorn's choice
        return "auto"

    class CoalescingHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            # duck-typed: every transport method but write/close is the wrapped transport's
            super().connection_made(
                cast(asyncio.Transport, CoalescingTransport(transport, self.loop))
            )

    return CoalescingHttpToolsProtocol
