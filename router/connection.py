"""One HTTP connection of the router's front (router/http.py): uvicorn's h11 protocol with what it
lacks, each refusal an answer in the OpenAI error format, then the connection closed.

- Request headers must be in within header_timeout_s of the connection's opening or of its previous
  response, else it is closed (uvicorn has no such timeout); headers over MAX_HEADER_BYTES: 431.
- A body over max_body_bytes: 413 as soon as a Content-Length or a chunk size declares it, or the
  bytes that came take it over (a chunked body without a size), before the request is handled.
- Framing h11 takes but RFC 9112 calls faulty (section 6.1): 400. Content-Length beside
  Transfer-Encoding (h11 lets Transfer-Encoding win and waits for chunks that a client meaning
  Content-Length never sends: a hang until the body timeout; a proxy that read it the other way
  would be smuggling a request past us), and Transfer-Encoding in an HTTP/1.0 request.

After a refusal the connection lingers (`_linger`): half-closed (the answer, then the end of what we
send), it reads and drops what the client still sends until the client closes, at most
LINGER_BYTES more or linger_s. A client that sends its whole body before it reads (http.client,
requests, a raw socket: most do) gets its 413 so; closed at once, the kernel answers the bytes
still coming with a reset, and the answer is lost with the connection.
"""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from kvbridge import __version__
from kvbridge.router.openai_api import error_body

MAX_HEADER_BYTES = 64 << 10  # request line and headers (h11's limit on an incomplete event)
LINGER_BYTES = 64 << 20  # what a refused client may still send before its connection is closed
SERVER = f"kvbridge-router/{__version__}".encode()
HEADERS_TOO_LARGE = error_body(grpc.StatusCode.INVALID_ARGUMENT, f"request headers over {MAX_HEADER_BYTES} bytes")[1]


def body_too_large(limit: int) -> dict:
    return error_body(grpc.StatusCode.INVALID_ARGUMENT, f"body over {limit} bytes")[1]


class FrontProtocol(H11Protocol):
    """uvicorn's h11 protocol with the limits above; HTTPFront makes a subclass with their values."""

    header_timeout_s: float  # set on the subclass HTTPFront makes
    max_body_bytes: int  # (likewise)
    linger_s: float  # (likewise: the body timeout, the time the client had to send its body anyway)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, self.config.h11_max_incomplete_event_size)
        self._dropped: int | None = None  # bytes dropped since the connection began to linger (None: it does not)
        self._linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._dropped is not None:  # refused: what the client still sends is dropped
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self.transport.close()
            return
        super().data_received(data)
        # h11 tells no declared size but keeps what is left of it on its reader: what is left of the
        # chunk, or of a Content-Length body. A body that it takes over the limit is refused now, not
        # once the client sent it (or stalled), and before the request's handler reads it
        reader = getattr(self.conn, "_reader", None)
        pending = getattr(reader, "_bytes_in_chunk", None) or getattr(reader, "_remaining", 0)
        over = isinstance(pending, int) and self.conn.body_bytes + pending > self.max_body_bytes
        if over and not self.transport.is_closing():
            self._refuse(413, body_too_large(self.max_body_bytes))

    def on_response_complete(self) -> None:
        self._await_headers()  # before the next request can start (a pipelined one starts in there)
        super().on_response_complete()

    def shutdown(self) -> None:
        if self._dropped is not None:  # (a refused connection has nothing more to say)
            self.transport.close()
            return
        super().shutdown()

    def _await_headers(self) -> None:
        """Close the connection unless a request's headers are in within header_timeout_s. uvicorn
        makes a new cycle per request, so an unchanged cycle means none came."""
        if self._header_timer is not None:
            self._header_timer.cancel()
        waiting_in = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late, waiting_in)

    def _headers_late(self, waiting_in: object) -> None:
        self._header_timer = None
        if self.cycle is waiting_in and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # called inside uvicorn's `except h11.RemoteProtocolError`, so the error is at hand
        error = sys.exc_info()[1]
        status = getattr(error, "error_status_hint", 400)
        if status == 431:  # h11's "Receive buffer too long": headers still coming past the cap
            self._refuse(status, HEADERS_TOO_LARGE)
        else:
            self._refuse(status, error_body(grpc.StatusCode.INVALID_ARGUMENT, f"malformed HTTP request: {error}")[1])

    def _refuse(self, status: int, obj: dict) -> None:
        """Answer `status` with `obj` and close, whatever the request being handled does."""
        if self.cycle is not None and not self.cycle.response_complete:
            # the request being handled ends here: its answer goes nowhere, its reads see http.disconnect
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # an answer is under way: just close
            self.transport.close()
            return
        body = json.dumps(obj).encode()
        headers = [
            (b"Content-Type", b"application/json"),
            (b"Content-Length", str(len(body)).encode()),
            (b"Connection", b"close"),
            (b"Server", SERVER),
        ]
        for event in (
            h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self._linger()

    def _linger(self) -> None:
        """Close once the client stops sending: at its end of the connection, past LINGER_BYTES more,
        or after linger_s. Half-closed meanwhile (TLS has no half-close: the answer says how long it is)."""
        self._dropped = 0
        if self.transport.can_write_eof():
            self.transport.write_eof()  # (after the answer: the transport sends what it holds first)
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(self.linger_s, self.transport.close)


class _Connection(h11.Connection):
    """h11's server connection, counting the body bytes of the request being read, and refusing the
    faulty framing above (uvicorn answers through send_400_response)."""

    body_bytes = 0

    def next_event(self):
        event = super().next_event()
        if isinstance(event, h11.Request):
            self.body_bytes = 0
            if problem := _framing_problem(event):
                raise h11.RemoteProtocolError(problem, error_status_hint=400)
        elif isinstance(event, h11.Data):
            self.body_bytes += len(event.data)
        return event


def _framing_problem(request: h11.Request) -> str | None:
    names = {name for name, _ in request.headers}  # (lowercase)
    if b"transfer-encoding" not in names:
        return None
    if b"content-length" in names:
        return "both Content-Length and Transfer-Encoding: send one"
    if request.http_version == b"1.0":
        return "Transfer-Encoding in an HTTP/1.0 request"
    return None
