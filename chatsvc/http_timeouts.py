"""Read deadlines for HTTP requests: a client must send a request's headers, then its body, in bounded time.

uvicorn has no such limit (its ``timeout_keep_alive`` covers only the idle time between requests, and every
byte received resets it), so a client trickling its headers or body a byte at a time holds a connection, a
request object and a task open for as long as it likes. An ASGI middleware cannot see the headers phase at
all (the app is only called once they are parsed), so the deadlines live in the HTTP protocol object:
``read_deadline_protocol`` subclasses the uvicorn protocol ``--http`` names (httptools or h11).

- **Headers**: from the connection's start, or from the first byte of each later request on a kept-alive
  connection, until the request's headers are parsed.
- **Body**: from there until the request's body is complete. Disarmed as soon as it is, so a response that
  streams for minutes (a chat reply) is never cut; disarmed on a WebSocket upgrade, whose connection has
  timeouts of its own.

Past either, the client gets ``408 Request Timeout`` (unless a response already started) and the connection
is closed; an app still reading the body sees the client disconnect. The close lingers, as nginx's does: the
answer goes out with a FIN, and what the client still sends is read and dropped until it closes its side or
``LINGER_S`` pass. Closed at once, the socket would answer the client's next byte with a reset, and a reset
can reach the client before it has read the 408.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

log = logging.getLogger("chatsvc.http")

_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                     b"content-length: 16\r\nconnection: close\r\n\r\nrequest timeout\n")
LINGER_S = 2.0  # how long a timed-out client may go on sending after its answer before the socket is closed


class _ReadDeadlines(asyncio.Protocol):
    """Mixed in before a uvicorn HTTP protocol class; reads its ``transport``, ``cycle`` and ``client``."""

    header_timeout_s: float
    body_timeout_s: float
    transport: asyncio.Transport
    cycle: Any  # uvicorn's RequestResponseCycle of the request being served (None before the first)
    client: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._deadline: asyncio.TimerHandle | None = None
        self._reading = ""
        self._seen: Any = None  # the last cycle whose headers were complete
        self._upgraded = False
        self._linger: asyncio.TimerHandle | None = None  # set once the connection is timed out and closing
        super().connection_made(transport)
        self._arm("headers", self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            return  # after the 408: read only so that the socket has nothing unread when it closes
        cycle: Any = getattr(self, "cycle", None)
        if self._deadline is None and (cycle is None or cycle.response_complete):
            self._arm("headers", self.header_timeout_s)  # the first byte of a kept-alive connection's next request
        super().data_received(data)
        if self._upgraded:
            return
        cycle = getattr(self, "cycle", None)
        if cycle is not None and cycle is not self._seen:  # this request's headers are in
            self._seen = cycle
            self._disarm()
            if cycle.more_body:
                self._arm("body", self.body_timeout_s)
        elif self._reading == "body" and cycle is not None and not cycle.more_body:
            self._disarm()

    def handle_websocket_upgrade(self, *args: Any) -> None:
        self._disarm()
        self._upgraded = True
        super().handle_websocket_upgrade(*args)  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def _arm(self, what: str, timeout_s: float) -> None:
        self._disarm()
        self._reading = what
        self._deadline = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._reading = None, ""

    def _expire(self) -> None:
        what, self._deadline = self._reading, None
        timeout = self.header_timeout_s if what == "headers" else self.body_timeout_s
        log.info("closing the connection of %s: its request's %s took over %.0f s", self.client, what, timeout)
        cycle: Any = getattr(self, "cycle", None)
        in_flight = what == "body" and cycle is not None and not cycle.response_complete
        if not (in_flight and cycle.response_started):
            self.transport.write(_TIMEOUT_RESPONSE)
        if in_flight:  # the app reading the body sees a disconnect; what it sends next goes nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        # The client's EOF ends the linger early: uvicorn's eof_received returns None, so asyncio closes.
        self.transport.write_eof()
        self._linger = asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)


def read_deadline_protocol(http: str, header_timeout_s: float, body_timeout_s: float) -> type[asyncio.Protocol]:
    """The uvicorn HTTP protocol class ``http`` names ("auto", "h11", "httptools") with read deadlines, for
    ``uvicorn.Config(http=...)``."""
    base: type[asyncio.Protocol] = import_from_string(HTTP_PROTOCOLS[http])
    return type(f"ReadDeadline{base.__name__}", (_ReadDeadlines, base),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})
